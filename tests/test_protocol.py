"""Control messages: one encode/decode path, schema version, clear errors."""

from __future__ import annotations

import json

import pytest

from drift import protocol as P

SAMPLES = [
    P.NodeInfo(node_id="a" * 64, name="n", backend="torch", device="cpu", ring_ticket="t"),
    P.TrainConfig(run_id="r", recipe={"name": "x"}, commit=None),
    P.RepoCommit(repo="r", commit="c", tree="t", node_id="n", timestamp=1.5, nonce="ab",
                 param_checksum="cs", n_train=10),
    P.TrainingReady(nodes=["a"]), P.TrainingCancel(reason="why"), P.Ping(nonce=3), P.Pong(nonce=3),
    P.Heartbeat(round=1), P.ShardAssignment(round=1, epoch=0, units=[P.WorkUnit(id=1, lo=0, hi=64)], planned=3, report_val=True),
    P.TrainProgress(round=1, unit=P.WorkUnit(id=2, lo=0, hi=64), steps=2, loss=3.2, samples_per_s=100.0),
    P.AskForMoreWork(round=1), P.AssignNext(round=1, unit=P.WorkUnit(id=9, lo=32, hi=64)), P.NoMoreWork(round=1), P.StopRound(round=1),
    P.BarrierSync(round=1, samples=64, steps=2, loss=None, trained=[P.WorkUnit(id=1, lo=0, hi=64)],
                  returned=[P.WorkUnit(id=9, lo=32, hi=64)], val_loss=2.5, val_samples=8),
    P.BarrierReady(round=1, ring=[P.RingMember(node_id="a", ticket="t", weight=1.0)]),
    P.RoundDone(round=1, checksum="c"), P.RingFailed(round=1, ring_epoch=2, reason="gone"), P.EvalResult(after_round=1, val_loss=2.0, val_samples=8),
    P.ShardAssignment(round=2, epoch=0, units=[], role="evaluate",
                      state=P.StateSource(round=1, checksum="c", tickets=["t"])), P.CheckpointInfo(round=1, path="p", checksum="c"),
    P.TrainComplete(rounds=3, final_val_loss=1.0),
]


@pytest.mark.parametrize("msg", SAMPLES, ids=lambda m: m.type)
def test_round_trip(msg) -> None:
    assert P.decode(P.encode(msg)) == msg


@pytest.mark.parametrize("frame,needle", [
    (b"\xff\xfe", "not JSON"),
    (b"{\"v\": 1, \"type\": \"Ping\"", "not JSON"),            # truncated
    (b"[1,2]", "not a JSON object"),
    (b"{\"v\": 99, \"type\": \"Ping\"}", "schema version 99"),
    (b"{\"v\": 1, \"type\": \"Launch\"}", "type"),
    (b"{\"v\": 1, \"type\": \"AssignNext\", \"round\": 1}", "unit"),
    (b"{\"v\": 1, \"type\": \"AssignNext\", \"round\": 1, \"unit\": {\"id\": -1, \"lo\": 0, \"hi\": 1}}", "unit.id"),
    (b"{\"v\": 1, \"type\": \"AssignNext\", \"round\": \"x\", \"unit\": 1}", "round"),
    (b"{\"v\": 1, \"type\": \"Ping\", \"evil\": 1}", "evil"),
])
def test_malformed_frames_raise_protocol_error(frame: bytes, needle: str) -> None:
    with pytest.raises(P.ProtocolError) as e:
        P.decode(frame)
    assert needle in str(e.value)


def test_frames_carry_the_schema_version() -> None:
    assert json.loads(P.encode(P.Ping()))["v"] == P.SCHEMA_VERSION
