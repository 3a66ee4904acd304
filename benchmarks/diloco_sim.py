"""DiLoCo in one process, no network: how the outer optimizer and H change the loss at equal samples.

    python benchmarks/diloco_sim.py diloco --H 50 --outer-lr 1.3 --momentum 0
    python benchmarks/diloco_sim.py diloco --nodes 2 --steps 500 --H 25 --schedule --overlapped
    python benchmarks/diloco_sim.py ddp         # one worker, batch nodes x 32: what DDP computes
    python benchmarks/diloco_sim.py single      # one worker, batch 32, nodes x the steps
    python benchmarks/diloco_sim.py diloco --steps 500 --H 10 --schedule --sync sparse --outer-lr 2 --momentum 0

The default recipe's task, AdamW and θ0 (drift's own TorchWorker), the recipe's epoch-0 sample
order (then epoch 1's, ...); `--nodes` replicas train H steps each from the same θ, then the outer step (drift's
NesterovOuter) applies their mean pseudo-gradient. `--overlapped`: drift's OverlappedDiLoCo, the
replicas train on from where they were while the mean lands `--land-after` steps into the next
round, then move by what θ_global moved (catch_up). `--schedule`: bench_vs_ddp.py's inner lr
(5 % warmup, cosine to lr/10 or `--min-lr` over the run, from the samples all replicas trained),
held for a round at its mid-round value as drift's nodes hold it (a real node trains on the same
samples at the same lr: one node's val loss matches a real swarm's to 4 digits for 8 rounds,
then drifts only where a real round stopped a step early). It isolates the algorithm from the transport:
bench_vs_ddp.py runs the same comparison with real processes over real links. Prints the val
loss after every H steps per replica.

`--sync sparse`: drift's sparse rule (drift/sync/sparse.py) instead: each replica's error feedback,
chunked top-k payloads, decoded, clipped and summed as every node does (outer lr `--outer-lr`, no
momentum). `--int8`: the dense mean of int8-coded Δs, as the ring's codec would send them.
`--uneven [DEAL]`: each round deals the replicas unequal steps, as the steal schedule does (H - 3
to H + 1 each, at random from the seed DEAL, 7 by default, N x H in all: a real 4-node round at H 10 ranged 7 to 11),
and weights each Δ by its share of the round's samples, as drift does. `--hostile F`: replica 0
sends F x its Δ (what an attacker achieves within the sparse rule's clip). `--fanout G`: the
sparse payloads go up drift/hierarchy.py's levels of at most G blocks (benchmarks/harness/tree.py:
each replica merges what its node would receive), where the default all-gathers them flat.
`--scatter`: they are reduce-scattered instead (harness.tree.scattered_round: each segment's owner
sums every replica's piece of it, and every replica applies the owners' int8 sums).
`--dense-first F`: a sparse run's first F rounds are the int8 ring's (outer lr `--dense-lr`, no
momentum), its error feedback empty until the first sparse round: the rule's own `dense_rounds`
and `dense_lr` (0 here unless given, as the runs in BENCHMARKS.md before the rule had them;
`--lr-growth` likewise is the rule's `lr_growth`, 1 here unless given: `--outer-lr` at any size); with `--k-first K` they are the
sparse rule's all-gather with K values a chunk (outer lr `--dense-lr`) instead. The
last line counts what each node would send over the run: a ring sends 2(N-1)/N payloads per node
per round, the direct all-gather N-1, the hierarchy the most any member uploads (hierarchy.transfers),
the reduce-scatter the most any member uploads (drift.sync.sparse.scatter_transfers).
"""

from __future__ import annotations

import argparse
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]

from drift import hierarchy  # noqa: E402
from drift import protocol as P  # noqa: E402
from drift.compress import make_codec  # noqa: E402
from drift.diloco import NesterovOuter, ParamLayout, epoch_order  # noqa: E402
from drift.recipe import Recipe, load_recipe  # noqa: E402
from drift.sync import collective, make_rule  # noqa: E402
from drift.workers import load_task  # noqa: E402
from drift.workers.torch_worker import TorchWorker  # noqa: E402
from harness.tree import hierarchical_round, scattered_round  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("mode", choices=["diloco", "ddp", "single"])
    ap.add_argument("--nodes", type=int, default=4)
    ap.add_argument("--steps", type=int, default=300, help="inner steps per replica (ddp: steps)")
    ap.add_argument("--H", type=int, default=50)
    ap.add_argument("--outer-lr", type=float, default=0.7)
    ap.add_argument("--momentum", type=float, default=0.9)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--schedule", action="store_true", help="warmup 5 %% + cosine to --min-lr, as bench_vs_ddp.py")
    ap.add_argument("--min-lr", type=float, default=0.1, help="--schedule: the cosine's end, a fraction of the lr")
    ap.add_argument("--overlapped", action="store_true", help="the outer step lands a round late (OverlappedDiLoCo)")
    ap.add_argument("--land-after", type=int, default=2, help="overlapped: inner steps before the mean lands")
    ap.add_argument("--sync", choices=["dense", "sparse"], default="dense")
    ap.add_argument("--int8", action="store_true", help="dense: each Δ through drift's int8 codec")
    ap.add_argument("--k", type=int, default=64, help="sparse: values kept per chunk")
    ap.add_argument("--fanout", type=int, default=0, help="sparse: the hierarchy's fanout (0: all-gather flat)")
    ap.add_argument(
        "--scatter", action="store_true", help="sparse: reduce-scatter to segment owners, all-gather their int8 sums"
    )
    ap.add_argument("--chunk", type=int, default=4096, help="sparse: values per chunk")
    ap.add_argument(
        "--uneven",
        type=int,
        nargs="?",
        const=7,
        metavar="DEAL",
        help="unequal steps per replica each round (the steal schedule), dealt from this seed (default 7)",
    )
    ap.add_argument("--hostile", type=float, default=None, help="replica 0 sends this many times its Δ")
    ap.add_argument("--clip", type=float, default=1.0, help="sparse: clip to this x the median contribution")
    ap.add_argument("--ef-decay", type=float, default=0.95, help="sparse: error feedback's decay")
    ap.add_argument(
        "--dense-first", type=int, default=0, help="sparse: the first this many rounds go as the int8 ring instead"
    )
    ap.add_argument(
        "--k-first", type=int, default=0, help="--dense-first: those rounds send this k, all-gathered, instead of int8"
    )
    ap.add_argument("--dense-lr", type=float, default=1.3, help="--dense-first: those rounds' outer lr (no momentum)")
    ap.add_argument(
        "--lr-growth", type=float, default=1.0, help="sparse: the rule's lr_growth (1: --outer-lr whatever the nodes)"
    )
    ap.add_argument("--seed", type=int, default=None, help="θ0 and the sample order (default: the recipe's)")
    ap.add_argument("--inner-lr", type=float, default=None, help="AdamW's lr (default: the recipe's)")
    ap.add_argument("--batch", type=int, default=None, help="samples an inner step (default: the recipe's)")
    ap.add_argument("--model", nargs="*", default=[], metavar="KEY=INT", help="task_config, e.g. n_layer=8 n_embd=512")
    a = ap.parse_args()
    if a.uneven is not None and a.overlapped:
        ap.error("--uneven is for blocking rounds only")

    r = load_recipe(ROOT / "recipes" / "shakespeare.yaml")
    lr = a.inner_lr or r.inner_optimizer.lr
    run = {
        "batch_size": a.batch or r.batch_size,
        "rounds": a.steps // a.H,
        "inner_steps": a.H,
        "min_nodes": a.nodes,
        "round_samples": None,  # derived again: the round's budget (hence the schedule's span) is this run's
        "seed": r.seed if a.seed is None else a.seed,
        "inner_optimizer": {**r.inner_optimizer.model_dump(), "lr": lr},
        "task_config": r.task_config | {k: int(v) for k, v in (kv.split("=", 1) for kv in a.model)},
    }
    total = a.nodes * a.steps * run["batch_size"]
    if a.schedule:
        run["lr_schedule"] = {"warmup_samples": total // 20, "min_lr": lr * a.min_lr}
    r = Recipe.model_validate(r.model_dump() | run)
    task = load_task(ROOT / r.task)

    def worker() -> TorchWorker:
        return TorchWorker(
            task, r.task_config, r.inner_optimizer.model_dump(), device="cpu", seed=r.seed, threads=a.threads
        )

    w0 = worker()
    epochs = -(-total // w0.n_train)  # a run longer than the data goes on into the next epoch's order
    order = np.concatenate([epoch_order(w0.n_train, r.seed, e) for e in range(epochs)])
    B, N, H = r.batch_size, a.nodes, a.H
    if a.mode != "diloco":  # one worker: ddp = batch N*B for `steps`; single = batch B for N*steps
        batch, steps = (N * B, a.steps) if a.mode == "ddp" else (B, N * a.steps)
        every = H if a.mode == "ddp" else N * H
        for k in range(steps):
            w0.set_lr(r.inner_lr(k * batch))
            w0.train_step(order[k * batch : (k + 1) * batch])
            if (k + 1) % every == 0:
                print(f"{(k + 1) * batch:>7} samples  val {w0.evaluate(r.eval_batches, B):.4f}", flush=True)
        return
    replicas = [w0] + [worker() for _ in range(N - 1)]
    layout = ParamLayout.of(w0.get_params())
    theta = layout.flatten(w0.get_params())
    outer = NesterovOuter(theta.size, a.outer_lr, a.momentum)
    sent = 0  # bytes each node sends over the run
    if a.sync == "sparse":
        sr = r.model_copy(
            update={
                "sync": "sparse",
                "sync_params": {
                    **{"lr": a.outer_lr, "k": a.k, "chunk": a.chunk, "clip": a.clip, "ef_decay": a.ef_decay},
                    **{"dense_rounds": 0 if a.k_first else a.dense_first, "dense_lr": a.dense_lr},
                    "lr_growth": a.lr_growth,
                },
            }
        )
        rules = [make_rule(layout, sr) for _ in range(N)]  # each replica's own error feedback
        big = {"sync_params": {**sr.sync_params, "k": a.k_first, "lr": a.dense_lr, "dense_rounds": 0}}  # (--k-first)
        first_rules = [make_rule(layout, sr.model_copy(update=big)) for _ in range(N)] if a.k_first else []
        if a.scatter:
            per_round = rules[0].scatter_nbytes(N)[0]
        else:
            per_round = (hierarchy.transfers(N, a.fanout)[0] if a.fanout else N - 1) * rules[0].payload_nbytes
        scratch = np.zeros_like(theta)  # where the other replicas apply the same step
    else:
        codec = make_codec("int8" if a.int8 else "fp32")
        per_round = int(2 * (N - 1) / N * codec.encoded_nbytes(theta.size))

    codec8 = make_codec("int8")  # (--dense-first)

    def allgather(rs: list, deltas: list[np.ndarray], shares: np.ndarray, rnd: int) -> None:
        """The sparse rule's flat round: every replica's rule does what its node would (its error
        feedback moves on), replica 0's on θ_global."""
        ring = [P.RingMember(node_id=f"{i:064x}", ticket="t", weight=float(w)) for i, w in enumerate(shares)]
        payloads = [rule.contribute(d, w, rnd) for rule, d, w in zip(rs, deltas, shares)]
        for rule in rs:
            rule.combine(payloads, ring)
            rule.apply(theta if rule is rs[0] else scratch)

    def ring_round(rs: list, deltas: list[np.ndarray], shares: np.ndarray, rnd: int) -> None:
        """One of the sparse rule's dense rounds: what each rule gives the ring (w·Δ), summed as
        the int8 ring's codec sends it (a ring of one sends nothing), then each rule's step."""
        ring = [P.RingMember(node_id=f"{i:064x}", ticket="t", weight=float(w)) for i, w in enumerate(shares)]
        mine = [rule.contribute(d, w, rnd) for rule, d, w in zip(rs, deltas, shares)]
        total = sum(codec8.decode(codec8.encode(x), np.empty_like(x)) if N > 1 else x.copy() for x in mine)
        for rule, x in zip(rs, mine):
            x[...] = total
            rule.combine(x, ring)
            rule.apply(theta if rule is rs[0] else scratch)

    def step(deltas: list[np.ndarray], shares: np.ndarray, rnd: int) -> None:
        """θ_global after round `rnd`, from the replicas' Δs and their shares of the round's
        samples, by the rule."""
        nonlocal sent
        if a.sync == "sparse" and first_rules and rnd < a.dense_first:  # (--k-first)
            # the sparse rule with a larger k; its error feedback carries on
            sent += (N - 1) * first_rules[0].payload_nbytes
            allgather(first_rules, deltas, shares, rnd)
            if rnd == a.dense_first - 1:
                for rule, first in zip(rules, first_rules):
                    rule.ef = first.ef.copy()
            return
        if a.sync == "sparse" and collective(sr, rnd) == "ring":  # (the error feedback stays empty)
            sent += int(2 * (N - 1) / N * codec8.encoded_nbytes(theta.size))
            ring_round(rules, deltas, shares, rnd)
            return
        sent += per_round
        if a.hostile is not None:
            deltas[0] = deltas[0] * np.float32(a.hostile)
        if a.sync == "sparse" and a.scatter:
            scattered_round(rules, deltas, list(shares), rnd)
            for rule in rules:
                rule.apply(theta if rule is rules[0] else scratch)
            return
        if a.sync == "sparse" and a.fanout:
            hierarchical_round(rules, deltas, list(shares), a.fanout, rnd)
            for rule in rules:
                rule.apply(theta if rule is rules[0] else scratch)
            return
        if a.sync == "sparse":
            allgather(rules, deltas, shares, rnd)
            return
        if a.int8:
            deltas = [codec.decode(codec.encode(d), np.empty_like(d)) for d in deltas]
        outer.step(
            theta,
            np.mean(deltas, axis=0) if a.uneven is None else sum(np.float32(w) * d for w, d in zip(shares, deltas)),
        )

    local = [theta.copy() for _ in replicas]  # each replica's θ_local
    pending = None  # overlapped: (mean Δ, each replica's θ_local at the barrier)
    pos = 0

    def train(i: int, w: TorchWorker, n: int) -> None:
        nonlocal pos
        w.set_params(layout.unflatten(local[i]))
        # held for the round, from the swarm's progress (drift.inner)
        lr = r.round_lr(pos - pos % (N * H * B))
        for _ in range(n):
            w.set_lr(lr)
            w.train_step(order[pos : pos + B])
            pos += B
        local[i] = layout.flatten(w.get_params())

    even = np.full(N, 1 / N)

    def land(rnd: int) -> None:
        """The all-reduce of the round before lands: the outer step, then every replica keeps the
        progress it made since its barrier on top of the new θ_global (OverlappedDiLoCo.catch_up)."""
        deltas, snaps = pending
        step(deltas, even, rnd)
        for i in range(N):
            local[i] += theta - snaps[i]

    deal = np.random.default_rng(a.uneven)
    for rnd in range(a.steps // H):
        steps = np.full(N, H)
        while a.uneven is not None:  # the steal schedule's spread: unequal shares, the same round total
            steps = deal.integers(H - 3, H + 2, N)
            if steps.sum() == N * H:
                break
        # pos: the samples all replicas trained (one after another here; at once in a swarm)
        first = min(a.land_after, H) if pending is not None else 0
        for i, w in enumerate(replicas):
            train(i, w, first)
        if pending is not None:
            land(rnd - 1)
            pending = None
        for i, w in enumerate(replicas):
            train(i, w, int(steps[i]) - first)
        deltas = [theta - x for x in local]
        if a.overlapped:
            pending = (deltas, [x.copy() for x in local])
        else:
            step(deltas, steps / steps.sum() if a.uneven is not None else even, rnd)
            local = [theta.copy() for _ in replicas]
        w0.set_params(layout.unflatten(theta))
        print(f"{pos:>7} samples  round {rnd}  val {w0.evaluate(r.eval_batches, B):.4f}", flush=True)
    if pending is not None:  # the last round's outer step lands after the run, as in drift
        land(a.steps // H - 1)
        w0.set_params(layout.unflatten(theta))
        print(f"{pos:>7} samples  final  val {w0.evaluate(r.eval_batches, B):.4f}", flush=True)
    print(
        f"sent per node over the run: {sent / 2**20:.3f} MiB ({sent} bytes, {theta.size} values, {a.steps // H} rounds)"
    )


if __name__ == "__main__":
    main()
