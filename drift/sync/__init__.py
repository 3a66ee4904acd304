"""Sync rules: how a node's progress becomes the swarm's. A rule is one file in this package.

A rule declares
  * `Params`: its hyperparameters (a pydantic model: the recipe's `sync_params`, checked when the
    recipe is read; a bad value is one line naming the field);
  * `STATE` and `state`: the outer state every node holds identically, as named flat
    float32 arrays of θ's size (checksummed, transferred over drift-state/1, checkpointed and
    resumed by name, in this order);
  * `collective`: what carries the contributions: "ring" (an all-reduce of one dense vector,
    drift/ring.py) or "allgather" (every member's payload reaches every member, drift/gather.py);
    a rule may pick it by the round (`collective_at`: the recipe and the round number only, so the
    coordinator and every node agree without a word about it);
  * the round's lifecycle, in this order (the rule keeps what one round needs in between):
      `contribute(delta, weight, rnd)`: what this node sends in round `rnd`, from its Δ (`delta`: the node's buffer,
      which the rule may use until the round ends; for the ring: the vector to sum, in place);
      `combine(result, ring)`: the round's update, from what the collective returned (the ring's
      sum, or every member's payload in ring order), plus what looked wrong;
      `preview(theta)`: the checksum apply would lead to, with nothing changed (a ring of two
      compares it before either member applies: with no majority, that is how a bad step is
      caught before it lands);
      `apply(theta)`: θ and the rule's state after the round, or `abandon()`: the round's
      contribution was not used here. A retried attempt starts again at `contribute`.

Whether the outer step is waited for (blocking) or lands one round late while the next round
trains is not the rule's business: the recipe's `overlap` says, and only the node and the
coordinator's round loop read it (`catch_up` is the arithmetic of it).

Invariant: every node runs the same float32 operations, in the same order, on the same inputs,
so θ and the state stay bit-identical across the swarm; the checksum proves it each round.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, ClassVar, Literal

import numpy as np
from pydantic import BaseModel, ConfigDict

from drift.diloco import CHUNK, ParamLayout, reduced_problem

if TYPE_CHECKING:
    from drift.protocol import RingMember
    from drift.recipe import Recipe


class Params(BaseModel):
    """A rule's hyperparameters (none by default); unknown fields are mistakes."""

    model_config = ConfigDict(extra="forbid", frozen=True)


@dataclass
class Combined:
    """What a node found while combining the round's contributions."""

    problem: str | None = None  # the result must not be applied (θ stays), and why
    outliers: list[str] = field(default_factory=list)  # members whose contribution was far outside the others'
    check_s: float = 0.0  # seconds spent checking the result (not combining it): the cost of trust


class SyncRule:
    """The base of every rule (see the module's docstring)."""

    name: ClassVar[str]
    collective: ClassVar[Literal["ring", "allgather"]] = "ring"
    Params: ClassVar[type[Params]] = Params
    STATE: ClassVar[tuple[str, ...]] = ()  # the shared state's arrays, in checksum/transfer/checkpoint order

    def __init__(self, layout: ParamLayout, recipe: Recipe):
        self.layout = layout
        self.params = self.Params.model_validate(recipe.sync_params)
        self.ring_codec = recipe.codec  # what the ring's rounds are encoded in (checked_sum)
        self.state: dict[str, np.ndarray] = {n: np.zeros(layout.size, np.float32) for n in self.STATE}

    @classmethod
    def collective_at(cls, params: Params, rnd: int) -> Literal["ring", "allgather"]:
        """The collective that carries round `rnd`'s contributions under `params`."""
        return cls.collective

    def contribute(self, delta: np.ndarray, weight: float, rnd: int):
        raise NotImplementedError

    def combine(self, result, ring: list[RingMember], bound: float | None = None) -> Combined:
        """What the collective brought, checked (`bound`: what a summed Δ's norm may reach,
        BarrierReady.bound; None: no check) and kept for apply()."""
        raise NotImplementedError

    def apply(self, theta: np.ndarray) -> None:
        raise NotImplementedError

    def preview(self, theta: np.ndarray) -> str:
        """checksum(θ, *state) as apply(θ) would leave them, bit for bit, changing nothing."""
        raise NotImplementedError

    def abandon(self) -> None:
        """The round's contribution was not used here (θ came from a peer, or the round was
        given up): forget anything kept for it."""


def weighted(delta: np.ndarray, weight: float) -> np.ndarray:
    """delta <- w * Δ in place: what a member gives the ring to sum. Weight 0 gives exact zeros
    (0 * NaN is NaN: a node whose Δ went bad sends nothing)."""
    if weight == 0:
        delta[...] = 0
    else:
        delta *= np.float32(weight)
    return delta


def checked_sum(total: np.ndarray, bound: float | None, codec: str) -> Combined:
    """The ring's sum in the recipe's `codec`, refused if larger than the members' reported norms
    allow (`bound`, BarrierReady.bound: someone sent more than it reported). Top-k re-sparsifies
    at every hop, so its sum has no norm bound and is not checked."""
    t = time.perf_counter()
    problem = reduced_problem(total, bound) if codec != "topk" else None
    return Combined(problem, check_s=time.perf_counter() - t)


def catch_up(theta_global: np.ndarray, snapshot: np.ndarray) -> None:
    """One-round-late outer steps (recipe `overlap`): snapshot <- θ_global - snapshot, what to add
    to the local copy, which was `snapshot` at the barrier (θ_local + θ_global_new -
    θ_local_at_barrier). The node keeps the progress it made since, and its next Δ is measured
    from the new θ_global, so no sample counts twice and none is lost."""
    for a in range(0, snapshot.size, CHUNK):
        np.subtract(theta_global[a : a + CHUNK], snapshot[a : a + CHUNK], out=snapshot[a : a + CHUNK])


ALIASES = {"blocking": ("dense", False), "overlapped": ("dense", True)}  # the names before `overlap`


def rules() -> dict[str, type[SyncRule]]:
    """Every rule, by the name a recipe's `sync` gives it."""
    from drift.sync.dense import DenseDiLoCo
    from drift.sync.sparse import SparseLoCo

    return {r.name: r for r in (DenseDiLoCo, SparseLoCo)}


def rule_class(recipe: Recipe) -> type[SyncRule]:
    return rules()[recipe.sync]


def collective(recipe: Recipe, rnd: int) -> Literal["ring", "allgather"]:
    """What carries round `rnd`'s contributions under the recipe's rule."""
    cls = rule_class(recipe)
    return cls.collective_at(cls.Params.model_validate(recipe.sync_params), rnd)


def make_rule(layout: ParamLayout, recipe: Recipe) -> SyncRule:
    return rule_class(recipe)(layout, recipe)
