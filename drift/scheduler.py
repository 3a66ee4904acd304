"""Work units: how a round's sample budget is cut up and handed out.

The epoch is a fixed permutation of the training samples (diloco.epoch_order), tiled into units
of `unit_samples`. Each round takes the next units of the epoch; units cut short come back to the
front of the queue, so every unit of an epoch is trained exactly once.
"""

from __future__ import annotations

from collections import deque


class UnitQueue:
    """The epoch's units not yet handed out, plus those given back."""

    def __init__(self, n_samples: int, unit_samples: int):
        if n_samples < 1:
            raise ValueError("the task has no training samples")
        self.units_per_epoch = -(-n_samples // unit_samples)
        self.epoch = 0
        self._next = 0
        self._returned: deque[int] = deque()

    def take(self, k: int) -> tuple[int, list[int]]:
        """Up to k units of the current epoch (a new epoch starts when it is used up)."""
        if not self._returned and self._next >= self.units_per_epoch:
            self.epoch += 1
            self._next = 0
        out: list[int] = []
        while self._returned and len(out) < k:
            out.append(self._returned.popleft())
        n = min(k - len(out), self.units_per_epoch - self._next)
        out += range(self._next, self._next + n)
        self._next += n
        return self.epoch, out

    def give_back(self, units: list[int]) -> None:
        self._returned.extendleft(reversed(units))


def split_proportional(units: list[int], speeds: list[float]) -> list[list[int]]:
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
        shares.append(units[i:i + c])
        i += c
    return shares
