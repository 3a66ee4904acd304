"""What admitting N nodes costs the coordinator's uplink (issue 40): the TrainingReady each member
gets, encoded as it goes on the wire, with real Ed25519-signed RepoCommits. Before drift/peers.py
it carried every member's RepoCommit (N of them to each of N nodes); now the member ids and
auth_threshold's few, and each node verifies a peer's own RepoCommit as they first talk. And
one node joining a swarm of N: every member got the whole membership again; now the newcomer
gets it, the others what changed (MembersChanged). And the first ring: every member was told
every member's ring ticket; now those of the members it connects to (drift.round.Round.links),
measured on the real round logic in virtual time (benchmarks/harness/rounds.py) with tickets as
long as a real one of this machine (an iroh endpoint bound as `network: lan`).

    python3 benchmarks/bench_admission.py --nodes 16 64 256 1000
"""

from __future__ import annotations

import argparse
import asyncio
import hashlib
import logging
import os
import time

from drift import protocol as P
from drift.auth import Admission, NodeKey, sign_message
from drift.coordinator import members_changed, ready_message
from drift.recipe import Recipe
from drift.transport import Endpoint
from harness.rounds import Failures, VirtualSwarm


def signed(key: NodeKey, commit: str, run: str) -> dict:
    """`key`'s RepoCommit as a real node signs it (a repo URL, a commit, a tree, a layout digest)."""
    body = P.RepoCommit(
        repo="https://github.com/someone/their-model.git",
        commit=commit,
        tree=hashlib.sha1(b"tree").hexdigest(),
        node_id=key.node_id,
        timestamp=time.time(),
        nonce=os.urandom(16).hex(),
        param_checksum=hashlib.sha256(b"theta0").hexdigest(),
        n_train=1_000_000,
        n_params=124_000_000,
        layout=hashlib.sha256(b"layout").hexdigest(),
        run_id=os.urandom(8).hex(),
    ).model_dump(mode="json")
    body["run_id"] = run
    return sign_message(key, body)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--nodes", type=int, nargs="+", default=[16, 256, 1000])
    args = ap.parse_args()
    commit, run = hashlib.sha1(b"c").hexdigest(), os.urandom(8).hex()
    keys = [NodeKey.generate() for _ in range(max(args.nodes) + 1)]
    admission = Admission(commit=commit, run_id=run)
    rcs = []
    for k in keys:
        rc = signed(k, commit, run)
        admission.verify(rc, k.node_id)
        rcs.append(rc)
    print("admitting N nodes: the TrainingReady to each, and to all")
    print("nodes  every RepoCommit: a node  all nodes   ids + auth_threshold's: a node  all nodes")
    for n in args.nodes:
        ids = [k.node_id for k in keys[:n]]
        before = len(P.encode(P.TrainingReady(nodes=ids, signatures=rcs[:n])))
        after = len(P.encode(ready_message(admission, ids, None)))
        print(f"{n:5d}  {before:24,d}  {n * before / 1e6:8.1f} MB   {after:29,d}  {n * after / 1e6:8.1f} MB")
    print("one node joining N members: what the coordinator sends in all")
    print("nodes  everyone the whole membership   the newcomer it, the others what changed")
    for n in args.nodes:
        ids = [k.node_id for k in keys[: n + 1]]
        whole = len(P.encode(ready_message(admission, ids, None)))
        changed = len(P.encode(members_changed(set(ids[:n]), ids)))
        print(f"{n:5d}  {(n + 1) * whole / 1e6:27.2f} MB   {(whole + n * changed) / 1e6:40.3f} MB")
    ticket = asyncio.run(_real_ticket())
    logging.disable(logging.WARNING)  # (the stand-in nodes claim no speed: a line each)
    print(f"the first ring: the tickets sent (a ticket of this machine: {len(ticket)} characters)")
    print("nodes  every member's to each   dense (ring, grid from 64)   sparse (all-gather, levels from 65)")
    for n in args.nodes:
        every = n * len(P.encode(P.Tickets(tickets={f"{k:064x}": f"{ticket}{k}" for k in range(n - 1)})))
        sparse = {"sync": "sparse", "sync_params": {"dense_rounds": 0}}  # (a gather round, at the default fanout)
        told = [_first_ring_tickets(n, ticket, **rule) for rule in ({}, sparse)]
        print(f"{n:5d}  {every / 1e6:19.2f} MB   {told[0] / 1e6:23.2f} MB   {told[1] / 1e6:17.2f} MB")


async def _real_ticket() -> str:
    ep = await Endpoint.bind("lan")
    try:
        return ep.ticket()
    finally:
        await ep.close()


def _first_ring_tickets(n: int, ticket: str, **rule) -> int:
    """Bytes of Tickets the coordinator sends in round 0 of n nodes."""
    r = Recipe(name="t", task="x.py", rounds=2, min_nodes=n, inner_steps=4, batch_size=8, unit_steps=1, **rule)
    sw = VirtualSwarm(r, [100.0] * n, Failures(), ticket=ticket)
    sw.run(1)
    return sw.sent["Tickets"]


if __name__ == "__main__":
    main()
