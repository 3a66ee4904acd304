"""Work units: how a round's sample budget is cut up, planned by speed, and handed out.

The epoch is a fixed permutation of the training samples (diloco.epoch_order), tiled into units
of `unit_samples`. A WorkUnit(id, lo, hi) is samples [lo, hi) of unit `id`.

Exactly once: the coordinator's event loop is the only place that grants units, and it grants
each unit to one node at a time. What a node did not train (cut by StopRound, never started, or
lost with a node that left) comes back to the front of the UnitQueue; what was trained counts
only when it made it into θ (the node's Δ was reduced): the round's result, and each member's
`trained` in its `round` event.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from drift.protocol import WorkUnit


@dataclass(frozen=True)
class Taken:
    """A round's share of the queue (UnitQueue.take_round): `units` worth about `budget` samples,
    the epoch of the first, and the queue's position() before they were taken."""

    budget: int
    epoch: int
    units: list[WorkUnit]
    before: dict


class UnitQueue:
    """The samples not yet trained: pieces handed back first, then fresh units of the current
    epoch, then the next epoch's (a round does not stop short at an epoch's end)."""

    def __init__(self, n_samples: int, unit_samples: int):
        if n_samples < 1:
            raise ValueError("the task has no training samples")
        self.n_samples = n_samples
        self.unit_samples = unit_samples
        self.units_per_epoch = -(-n_samples // unit_samples)
        self.epoch = 0
        self._next = 0
        self._returned: deque[WorkUnit] = deque()

    def full(self, uid: int) -> WorkUnit:
        return WorkUnit(
            epoch=self.epoch, id=uid, lo=0, hi=min(self.unit_samples, self.n_samples - uid * self.unit_samples)
        )

    def take(self, budget: int) -> tuple[int, list[WorkUnit]]:
        """Units worth about `budget` samples (at least one), and the epoch of the first."""
        out: list[WorkUnit] = []
        got = 0
        while got < budget:
            if self._returned:
                u = self._returned.popleft()
            else:
                if self._next >= self.units_per_epoch:
                    self.epoch, self._next = self.epoch + 1, 0
                u, self._next = self.full(self._next), self._next + 1
            out.append(u)
            got += u.hi - u.lo
        return out[0].epoch, out

    def take_round(self, budget: int) -> Taken:
        """A round's units (take), with the position before them."""
        before = self.position()
        epoch, units = self.take(budget)
        return Taken(budget, epoch, units, before)

    def position(self) -> dict:
        """Where the data stands: every sample of epochs before `epoch`, and of units [0, next_unit)
        of `epoch`, was trained, except the `pending` pieces ([epoch, id, lo, hi])."""
        return {
            "epoch": self.epoch,
            "next_unit": self._next,
            "pending": [[u.epoch, u.id, u.lo, u.hi] for u in self._returned],
        }

    def pending_samples(self) -> int:
        """Samples handed back and not trained yet (cut by StopRound, or lost with a node)."""
        return sum(u.hi - u.lo for u in self._returned)

    @staticmethod
    def with_pending(position: dict, units: list[WorkUnit]) -> dict:
        """A position() with `units` handed back on top (they are trained first)."""
        extra = [[u.epoch, u.id, u.lo, u.hi] for u in units if u.hi > u.lo]
        return {**position, "pending": extra + position["pending"]}

    def restore(self, position: dict) -> None:
        """Continue from a position() saved in a checkpoint."""
        self.epoch, self._next = int(position["epoch"]), int(position["next_unit"])
        self._returned = deque(
            WorkUnit(epoch=p[0], id=p[1], lo=p[2], hi=p[3])
            if len(p) == 4
            else WorkUnit(epoch=self.epoch, id=p[0], lo=p[1], hi=p[2])
            for p in position["pending"]
        )

    def give_back(self, units: list[WorkUnit]) -> None:
        self._returned.extendleft(reversed([u for u in units if u.hi > u.lo]))


def split_proportional(units: list, speeds: list[float]) -> list[list]:
    """Contiguous shares of `units`, sized in proportion to `speeds` (largest remainder)."""
    total = sum(speeds)
    exact = [len(units) * s / total for s in speeds]
    counts = [int(e) for e in exact]
    for i in sorted(range(len(speeds)), key=lambda i: exact[i] - counts[i], reverse=True):
        if sum(counts) >= len(units):
            break
        counts[i] += 1
    shares, i = [], 0
    for c in counts:
        shares.append(units[i : i + c])
        i += c
    return shares


@dataclass
class RoundPlan:
    """One round's units: planned per node by speed, granted as the nodes ask (next_for: one unit).

    With `steal`, a node whose plan is empty takes the last planned unit of the node expected to
    finish last (most planned samples per unit of speed). Without it (lockstep), nodes only ever
    get their own plan."""

    speeds: dict[str, float]
    steal: bool = True
    planned: dict[str, deque[WorkUnit]] = field(default_factory=dict)
    granted: dict[str, list[WorkUnit]] = field(default_factory=dict)
    orphans: deque[WorkUnit] = field(default_factory=deque)  # from nodes that left mid-round
    left: int = 0  # samples planned or orphaned, not granted (remaining(): asked at every grant)
    # Samples still planned per node with units planned: a steal weighs only these (summing every
    # queue at every steal was most of a thousand nodes' round logic)
    queued: dict[str, int] = field(default_factory=dict)

    @classmethod
    def make(cls, units: list[WorkUnit], speeds: dict[str, float], steal: bool = True) -> RoundPlan:
        ids = list(speeds)
        shares = split_proportional(units, [speeds[i] for i in ids])
        planned = {i: deque(s) for i, s in zip(ids, shares)}
        queued = {i: sum(u.hi - u.lo for u in q) for i, q in planned.items() if q}
        return cls(dict(speeds), steal, planned, {i: [] for i in ids}, left=sum(queued.values()), queued=queued)

    def grant_first(self, node: str, k: int = 1) -> list[WorkUnit]:
        out = [self.next_for(node) for _ in range(k)]
        return [u for u in out if u is not None]

    def next_for(self, node: str) -> WorkUnit | None:
        """The next unit this node should train, or None when nothing is left for it."""
        if node not in self.planned:
            return None
        if self.planned[node]:
            u = self._unplan(node, self.planned[node].popleft())
        elif self.orphans and self.steal:
            u = self.orphans.popleft()
        elif self.steal and self.queued:
            _, victim = max((n / self.speeds[v], v) for v, n in self.queued.items())
            u = self._unplan(victim, self.planned[victim].pop())
        else:
            return None
        self.granted[node].append(u)
        self.left -= u.hi - u.lo
        return u

    def _unplan(self, node: str, u: WorkUnit) -> WorkUnit:
        """Unit u left node's plan."""
        if self.planned[node]:
            self.queued[node] -= u.hi - u.lo
        else:
            self.queued.pop(node, None)
        return u

    def exhausted_for(self, node: str) -> bool:
        """Nothing more is there for this node this round: with stealing, nothing is left for
        anyone (until a node leaves and its units come back: Round._drop_from_plan); without, its own
        plan is granted."""
        return self.left == 0 if self.steal else not self.planned.get(node)

    def remaining(self) -> int:
        """Samples not yet granted to anyone."""
        return self.left

    def drop(self, node: str) -> None:
        """A node left or was excluded: everything granted to it (trained or not) is redone, and
        its plan goes to the others."""
        granted = self.granted.pop(node, [])
        self.orphans.extend(granted)  # (first: the order the others get them in)
        self.left += sum(u.hi - u.lo for u in granted)
        self.take(node)

    def take(self, node: str) -> list[WorkUnit]:
        """A node the round went on without (late): its granted units leave the plan with it (its
        late report says which it trained), and its plan goes to the others."""
        granted = self.granted.pop(node, [])
        self.orphans.extend(self.planned.pop(node, deque()))
        self.queued.pop(node, None)
        self.speeds.pop(node, None)
        return granted

    def leftover(self) -> list[WorkUnit]:
        """Units planned but never granted, at the end of the round."""
        out = list(self.orphans)
        for q in self.planned.values():
            out += q
        return out


def _merged(spans: list[tuple[int, int]]) -> list[tuple[int, int]] | None:
    """Sorted spans with touching ones joined; None if two overlap."""
    out: list[tuple[int, int]] = []
    for lo, hi in sorted(spans):
        if out and lo < out[-1][1]:
            return None
        if out and lo == out[-1][1]:
            out[-1] = (out[-1][0], hi)
        else:
            out.append((lo, hi))
    return out


def check_accounting(granted: list[WorkUnit], trained: list[WorkUnit], returned: list[WorkUnit]) -> str | None:
    """Trained + returned must tile exactly what was granted; returns what is wrong, or None."""

    def by_id(units: list[WorkUnit]) -> dict[tuple[int, int], list[tuple[int, int]]]:
        out: dict[tuple[int, int], list[tuple[int, int]]] = {}
        for u in units:
            if u.hi > u.lo:
                out.setdefault((u.epoch, u.id), []).append((u.lo, u.hi))
        return out

    def show(keys) -> str:
        return str(sorted(uid for _, uid in keys))

    want, got = by_id(granted), by_id([*trained, *returned])
    if set(got) - set(want):
        return f"reported units {show(set(got) - set(want))} it was never granted"
    if set(want) - set(got):
        return f"did not account for units {show(set(want) - set(got))}"
    for key, spans in want.items():
        pieces = _merged(got[key])
        if pieces is None:
            return f"reported samples of unit {key[1]} twice"
        if pieces != _merged(spans):
            return f"unit {key[1]}: reported {sorted(got[key])}, granted {sorted(spans)}"
    return None
