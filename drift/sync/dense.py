"""`sync: dense` (the default): DiLoCo. Every node contributes w_i * Δ_i, the ring all-reduce
sums them (compressed by the recipe's `codec`: int8 blocks by default), and the outer optimizer
(Nesterov SGD, `outer_optimizer`: lr 0.7, momentum 0.9) steps θ with the sum.

Hyperparameters: `outer_optimizer`, `codec`, `topk_fraction` (recipe fields older than the rule
package; `sync_params` takes none). Shared state: `velocity`, the outer momentum (zeros that are
never written without momentum: pages the OS does not back). The wire format and the checkpoint
format (outer.safetensors holds the velocity under the tensor names) are those of drift before
rules were files.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np

from drift.diloco import NesterovOuter, ParamLayout
from drift.sync import Combined, SyncRule, checked_sum, weighted

if TYPE_CHECKING:
    from drift.protocol import RingMember
    from drift.recipe import Recipe


class DenseDiLoCo(SyncRule):
    name = "dense"
    STATE = ("velocity",)

    def __init__(self, layout: ParamLayout, recipe: Recipe):
        super().__init__(layout, recipe)
        oo = recipe.outer_optimizer
        self.outer = NesterovOuter(layout.size, oo.lr, oo.momentum, oo.nesterov, params=layout.params_size)
        self.state = {"velocity": self.outer.velocity}
        self._sum: np.ndarray | None = None  # the round's: what contribute gave the ring, then the sum

    def contribute(self, delta: np.ndarray, weight: float, rnd: int) -> np.ndarray:
        """delta <- w * Δ, in place (the ring sums it there). A node of weight 0 sends exact zeros
        (0 * NaN is NaN: a node whose Δ went bad sends nothing)."""
        self._sum = weighted(delta, weight)
        return delta

    def combine(self, result: np.ndarray, ring: list[RingMember], bound: float | None = None) -> Combined:
        """The ring summed in place: refuse a sum larger than the members' reported norms allow
        (`bound`, BarrierReady.bound: someone sent more than it reported)."""
        assert result is self._sum
        return checked_sum(result, bound, self.ring_codec)

    def apply(self, theta: np.ndarray) -> None:
        """The outer Nesterov step (the sum is used as scratch)."""
        self.outer.step(theta, self._sum)

    def preview(self, theta: np.ndarray) -> str:
        return self.outer.preview(theta, self._sum)
