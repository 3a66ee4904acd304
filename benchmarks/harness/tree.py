"""The sparse rule's hierarchy (drift/hierarchy.py) run in one process: every member's rule
takes, level by level, the payloads its sources hold, as a swarm's nodes would receive them
(drift.gather.Gather.tree over the network). For tests of the arithmetic and for
benchmarks/diloco_sim.py's large swarms."""

from __future__ import annotations

import numpy as np

from drift import hierarchy
from drift import protocol as P
from drift.sync import Combined
from drift.sync.sparse import SparseLoCo


def node_id(i: int) -> str:
    return f"{i:064x}"


def hierarchical_round(
    rules: list[SparseLoCo],
    deltas: list[np.ndarray],
    weights: list[float],
    fanout: int = hierarchy.FANOUT,
    rnd: int | None = None,
) -> list[Combined]:
    """One round: member i contributes deltas[i] (its rule's buffer from then on) at weights[i];
    then every level, each member merges (the last level: combines) the payloads of its parent's
    children, taken from the members plan() names, each child weighing what its members weigh
    together (as Gather.tree). What each member found at the top."""
    n = len(rules)
    rnd = rules[0].params.dense_rounds if rnd is None else rnd  # (default: the first all-gathered round)
    held = [rule.contribute(d, w, rnd) for rule, d, w in zip(rules, deltas, weights)]
    levels = hierarchy.plan(n, fanout)
    for depth, level in enumerate(levels):
        found, nxt = [], []
        for m in range(n):
            sources = level.sources(m)
            result = [held[src] for _, src in sources]
            ring = [
                P.RingMember(node_id=node_id(src), ticket="t", weight=w)
                for (_, src), w in zip(sources, level.weights(m, weights))
            ]
            if depth == len(levels) - 1:
                found.append(rules[m].combine(result, ring))
            else:
                nxt.append(rules[m].merge(result, ring)[0])
        if depth == len(levels) - 1:
            return found
        held = nxt
    raise AssertionError("a plan always has a top level")


def scattered_round(
    rules: list[SparseLoCo], deltas: list[np.ndarray], weights: list[float], rnd: int | None = None
) -> list[list]:
    """One reduce-scattered round: member i contributes deltas[i] at weights[i]; the owner of each
    segment (drift.hierarchy.segments) sums its pieces of every payload (SparseLoCo.reduce), and
    every member applies the gathered sums (SparseLoCo.gathered). What each owner found wrong."""
    n = len(rules)
    rnd = rules[0].params.dense_rounds if rnd is None else rnd
    payloads = [rule.contribute(d, w, rnd) for rule, d, w in zip(rules, deltas, weights)]
    ring = [P.RingMember(node_id=node_id(i), ticket="t", weight=w) for i, w in enumerate(weights)]
    sums, found = [], []
    for owner, chunks in enumerate(hierarchy.segments(rules[0].codec.m, n)):
        if chunks:
            data, combined = rules[owner].reduce([rules[owner].piece(p, chunks) for p in payloads], ring, chunks)
            sums.append((chunks, data))
            found.append(combined.outliers)
    contributions = sum(1 for p, w in zip(payloads, weights) if p and w > 0)
    for rule in rules:
        rule.gathered(sums, contributions)
    return found
