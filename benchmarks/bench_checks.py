"""What the checks cost an honest node per round, for θ of a few sizes, next to the outer step:

  * the poisoning check: one L2 norm over the all-reduced Δ (diloco.reduced_problem; the norm of
    its own Δ was computed already, by DeltaCheck);
  * the binding of forwarded bytes to their owner (drift/ring.py): in a ring of --nodes, what one
    node does for it in a round: sha256 of every all-gather chunk it receives and of its own
    segment's, two Ed25519 verifications per chunk received and one signature per chunk sent
    (the ring's own functions, ~1 MiB chunks of the codec's payload);
  * in a ring of two (no majority), the preview: the checksum θ and the velocity will have after
    the outer step, computed before it is applied (SyncRule.preview). It replaces the checksum
    every other ring takes after the step (printed beside it), so what a ring of two adds is the
    difference, plus one round trip to the coordinator (Commit).

Prints one row per size and codec.

    python3 benchmarks/bench_checks.py [--sizes 10.8e6 124e6] [--nodes 4]

`--swarm`: the same checks timed where they run, in a real honest swarm on loopback (drift coord
and --nodes drift join processes, a char GPT of ~10.8M parameters, int8): each node reports what
its checks took in every round (RoundDone.check_s: the binding's hashes and signatures, the
sum's bound, in a ring of two the preview), printed next to the round's wall-clock and its sync,
and against a round of --h200-steps inner steps on an H200 (11 ms a step for this model at batch
64 x 256, DESIGN.md), where the checks weigh the most.

    python3 benchmarks/bench_checks.py --swarm [--nodes 4] [--rounds 6]
"""

from __future__ import annotations

import argparse
import hashlib
import statistics
import tempfile
import time
from pathlib import Path

import nacl.signing
import numpy as np

from drift.compress import make_codec
from drift.diloco import NesterovOuter, checksum, reduced_problem
from drift.ring import CHUNK_BYTES, hop_message, owner_message, verify


def best(fn, repeat: int = 5) -> float:
    out = []
    for _ in range(repeat):
        t = time.perf_counter()
        fn()
        out.append(time.perf_counter() - t)
    return min(out)


def binding(n: int, codec: str, nodes: int) -> tuple[float, float]:
    """(seconds, wire MiB) of one node's share of the binding in one round (see the docstring)."""
    wire = make_codec(codec).encoded_nbytes(n)
    payload = np.random.default_rng(1).integers(0, 255, min(wire, CHUNK_BYTES), dtype=np.uint8).tobytes()
    owner, me = nacl.signing.SigningKey.generate(), nacl.signing.SigningKey.generate()  # as Ring holds its own
    owner_id, me_id = bytes(owner.verify_key).hex(), bytes(me.verify_key).hex()
    received = -(-wire * (nodes - 1) // nodes // len(payload))  # all-gather chunks received
    own = -(-wire // nodes // len(payload))  # chunks of its own segment it signs
    sent = own * (nodes - 1)  # all-gather chunks it sends (its own segment and N-2 forwarded)

    def one_round() -> None:
        sig = bytes(64)
        for _ in range(own):
            owned = owner_message(me_id, 1, 0, 1, 0, 1, n, hashlib.sha256(payload).digest())
            sig = me.sign(owned).signature
        for _ in range(received):
            owned = owner_message(owner_id, 1, 0, 1, 0, 1, n, hashlib.sha256(payload).digest())
            verify(owner_id, hop_message(2, 0, owned, sig), sig)
            verify(owner_id, owned, sig)
        for _ in range(sent):
            me.sign(hop_message(2, 0, owned, sig))

    return best(one_round, 3), wire / 2**20


def row(n: int, nodes: int) -> list[str]:
    rng = np.random.default_rng(0)
    theta = rng.standard_normal(n, dtype=np.float32)
    reduced = rng.standard_normal(n, dtype=np.float32) * np.float32(1e-3)
    scratch = reduced.copy()  # the outer step uses the sum as scratch
    check = best(lambda: reduced_problem(reduced, 1.0))  # (4 members of weight 0.25, norm 1)
    outer = NesterovOuter(n)
    preview = best(lambda: outer.preview(theta, reduced), 3)
    hashed = best(lambda: checksum(theta, outer.velocity), 3)
    step = best(lambda: outer.step(theta, scratch))
    out = []
    for codec in ("int8", "fp32"):
        bind, mib = binding(n, codec, nodes)
        out.append(
            f"{n:>12,} {codec:>6} {check * 1e3:>9.1f} {bind * 1e3:>11.1f} {mib:>9.1f} {step * 1e3:>14.1f}"
            f" {check / step:>8.0%} {bind / step:>8.0%} {preview * 1e3:>11.1f} {hashed * 1e3:>12.1f}"
        )
    return out


def swarm(nodes: int, rounds: int, h200_steps: int) -> None:
    """A real honest swarm; per round: wall-clock, the slowest node's sync, the checks' seconds."""
    from harness.simulate import Swarm, make_task_repo

    recipe = {
        "name": "checks",
        "task_config": {"block_size": 64, "n_layer": 6, "n_head": 6, "n_embd": 384},  # 10.7M parameters
        "min_nodes": nodes,
        "rounds": rounds,
        "inner_steps": 4,
        "unit_steps": 2,
        "batch_size": 4,
        "eval_batches": 1,
        "codec": "int8",
        "checkpoint_every": rounds,
    }
    with tempfile.TemporaryDirectory(prefix="drift-checks-") as tmp:
        work = Path(tmp)
        s = Swarm(make_task_repo(work / "repo", recipe), work)
        for i in range(nodes):
            s.join(name=f"n{i}")
        if s.finish(timeout=1800) != 0:
            raise SystemExit(s.log()[-3000:])
        done = [e for e in s.events() if e["event"] == "round"]
    print(f"{nodes} nodes, {len(done)} rounds: per round, the slowest node's sync and checks (ms)")
    print(f"{'round':>5} {'wall s':>7} {'sync ms':>8} {'checks ms':>10} {'checks/sync':>12} {'checks/H200 round':>18}")
    h200_s = h200_steps * 0.011
    fractions = []
    for e in done:
        checks = max(n.get("check_s", 0.0) for n in e["nodes"].values())
        sync = max(n.get("sync_s", 0.0) for n in e["nodes"].values())
        fractions.append(checks / h200_s)
        print(
            f"{e['round']:>5} {e['seconds']:>7.2f} {sync * 1e3:>8.1f} {checks * 1e3:>10.1f} "
            f"{checks / sync if sync else 0:>12.1%} {checks / h200_s:>18.2%}"
        )
    print(f"median checks / an H200 round of {h200_steps} steps ({h200_s:.2f} s): {statistics.median(fractions):.2%}")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--sizes", type=float, nargs="+", default=[10.8e6, 124e6])
    ap.add_argument("--nodes", type=int, default=4)
    ap.add_argument("--swarm", action="store_true", help="time the checks in a real honest swarm instead")
    ap.add_argument("--rounds", type=int, default=6)
    ap.add_argument("--h200-steps", type=int, default=100)
    args = ap.parse_args()
    if args.swarm:
        return swarm(args.nodes, args.rounds, args.h200_steps)
    print(
        f"{'θ values':>12} {'codec':>6} {'check ms':>9} {'binding ms':>11} {'wire MiB':>9} {'outer step ms':>14}"
        f" {'check/':>8} {'binding/':>8} {'preview ms':>11} {'checksum ms':>12}  (/: of the outer step; ring of {args.nodes})"
    )
    for n in map(int, args.sizes):
        print("\n".join(row(n, args.nodes)))


if __name__ == "__main__":
    main()
