"""A swarm of 256 lightweight nodes (issue 40): the real `drift coord` process admits them all,
plans the round, runs the barrier and settles a ring all-reduce of 256 members (a grid of 16 rows
of 16, drift/ring.py), and its terminal stays a few dozen lines.

The nodes are drift's own Node (benchmarks/harness/light.py): two processes of 128, each node
with its own iroh endpoint and key, speaking the real protocol. Their stand-in task moves θ by a
deterministic function of the samples trained, so θ after the round is recomputed here from the
units metrics.jsonl says were trained, and every node must hold exactly that.
"""

from __future__ import annotations

import math
import re
from pathlib import Path

import numpy as np
import pytest
from conftest import check_exactly_once

from drift import hierarchy
from drift.gather import _HEADER as GATHER_HEADER
from drift.monitor import JOIN_LINES, ROUND_ROWS, read_events
from drift.ring import _HEADER as RING_HEADER
from drift.sync.sparse import Codec
from drift.transport import Throttle
from harness.light import LIGHT_SIZE, LightSwarm, light_theta, theta0

pytestmark = pytest.mark.swarm

N = 256


def test_256_lightweight_nodes_join_train_and_agree_on_theta(tmp_path: Path) -> None:
    s = LightSwarm(tmp_path, N, processes=2, rounds=1)
    rc, light = s.finish(timeout=280)
    events = s.events()
    assert rc == 0 and light == [0, 0], s.logs()

    # every node admitted, and every one of them in the round's barrier and ring
    joined = {e["node_id"] for e in events if e["event"] == "node_joined"}
    assert len(joined) == N
    assert next(e for e in events if e["event"] == "training_started")["nodes"] == N
    (rnd,) = [e for e in events if e["event"] == "round"]
    assert rnd["abandoned"] is None
    assert {n["node_id"] for n in rnd["nodes"].values()} == joined
    assert all(n["role"] == "train" for n in rnd["nodes"].values())
    r = s.recipe
    assert rnd["samples"] == N * r["inner_steps"] * r["batch_size"]  # the round's budget, all of it
    check_exactly_once(events, r["unit_steps"] * r["batch_size"])  # (every row: nodes.jsonl)
    # metrics.jsonl itself: the ROUND_ROWS members last at the barrier, and a summary of all N
    (line,) = [e for e in read_events(s.run_dir) if e["event"] == "round"]
    assert len(line["nodes"]) == ROUND_ROWS and line["summary"]["members"] == N
    assert line["summary"]["samples"] == rnd["samples"] and line["summary"]["counted"] == N
    assert (
        min(n["busy_s"] for n in line["nodes"].values())
        == sorted(n["busy_s"] for n in rnd["nodes"].values())[-ROUND_ROWS]
    )

    # θ: every node holds the round's agreed θ, and it is θ0 moved by the mean f(s) of the round's samples
    nodes = s.nodes()
    assert len(nodes) == N and all(v["code"] == 0 for v in nodes.values())
    assert {v["checksum"] for v in nodes.values()} == {rnd["checksum"]}
    assert {v["held"] for v in nodes.values()} == {0}
    want = light_theta(events, LIGHT_SIZE, r["task_config"]["n_train"], r["unit_steps"] * r["batch_size"], r["seed"])
    got = s.theta()
    moved = np.abs(want - theta0(LIGHT_SIZE)).max()
    assert moved > 0
    # float32: each node's Δ rounded once, times its weight, summed around a ring of N
    assert np.abs(got - want).max() <= (N + 2) * 2**-23 * (moved + np.abs(want).max()), (got, want)
    # as a grid: a node sends ~105 chunks a round (θ's 64 values leave many of its 256 segments
    # empty), where a member of a flat ring of 256 sends 510: fewer bytes than those 510's headers
    sent = [v["bytes_sent"] for v in rnd["nodes"].values()]
    assert min(sent) > 0 and max(sent) < 2 * (N - 1) * (RING_HEADER.size + 4), sorted(sent)

    # the coordinator's terminal: the first JOIN_LINES nodes by name, then a count at each doubling;
    # refusals (a machine's 256 nodes knock at once) at most Throttle's burst a minute; then the run
    lines = s.coord_log.read_text().splitlines()
    named = [line for line in lines if re.search(r"\blight-\d+\b", line)]
    assert len(named) <= JOIN_LINES + math.ceil(math.log2(N)), named
    minutes = math.ceil(max(e["t"] for e in events) / 60) + 1
    assert len(lines) <= 40 + len(named) + Throttle(print).burst * minutes, "\n".join(lines)


def test_64_lightweight_nodes_gather_the_sparse_rule_in_levels_of_bounded_bytes(tmp_path: Path) -> None:
    # sync: sparse above its fanout (16): 8 blocks of 8 (drift/hierarchy.py). Every node holds the
    # same θ after each round, and uploads 14 payloads a round where the flat all-gather takes 63.
    n, params = 64, {"chunk": 64, "k": 8, "fanout": 16, "dense_rounds": 0}
    s = LightSwarm(tmp_path, n, processes=2, rounds=2, sync="sparse", sync_params=params)
    rc, light = s.finish(timeout=200)
    events = s.events()
    assert rc == 0 and light == [0, 0], s.logs()
    rounds = [e for e in events if e["event"] == "round"]
    assert len(rounds) == 2 and all(r["abandoned"] is None for r in rounds), rounds
    nodes = s.nodes()
    assert len(nodes) == n and {v["checksum"] for v in nodes.values()} == {rounds[-1]["checksum"]}
    assert np.abs(s.theta() - theta0(LIGHT_SIZE)).max() > 0  # θ moved
    # A transfer: the gather header (with its 4-byte frame length), then the payload in one frame;
    # a member that trained nothing that round (a loaded machine hands the units to the others),
    # or a block none of whose members did, sends an empty payload: the header alone (the CI
    # failure of ceab3fb: 1,344 bytes = 7 of each). With all 64 in the ring a node makes
    # 14 a round, where the flat all-gather takes 63 (a loaded machine may sit a node out of a
    # round: then the plan of those left, hierarchy.transfers).
    head = GATHER_HEADER.size + 4
    each = head + Codec(LIGHT_SIZE, params["chunk"], params["k"]).nbytes + 4
    assert hierarchy.transfers(n, params["fanout"]) == (14, 14)
    for r in rounds:
        sent = [v["bytes_sent"] for v in r["nodes"].values()]
        ring = sum(1 for x in sent if x > 0)
        up = hierarchy.transfers(ring, params["fanout"])[0]
        made = [{a + b for a in range(up + 1) for b in range(up + 1 - a) if a * each + b * head == x} for x in sent]
        assert all(made) and max(sent) == up * each < (n - 1) * each, (ring, sorted(sent))
