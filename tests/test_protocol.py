"""Control messages: one encode/decode path, schema version, clear errors, bounds on every field."""

from __future__ import annotations

import json
import random
import typing

import pytest

from drift import protocol as P
from drift.transport import MAX_CONTROL_FRAME

A, B = "a" * 64, "b" * 64
SAMPLES = [
    P.NodeInfo(node_id=A, name="n", backend="torch", device="cpu", ring_ticket="t"),
    P.TrainConfig(run_id="r", recipe={"name": "x"}, commit=None),
    P.RepoCommit(repo="r", commit="c", tree="t", node_id=A, timestamp=1.5, nonce="ab", param_checksum="cs", n_train=10),
    P.TrainingReady(nodes=[A]),
    P.MembersChanged(joined=[A], left=[B]),
    P.Tickets(tickets={A: "t", B: "u"}),
    P.TrainingCancel(reason="why"),
    P.Ping(nonce=3),
    P.Heartbeat(round=1),
    P.ShardAssignment(round=1, epoch=0, units=[P.WorkUnit(id=1, lo=0, hi=64)], planned=3, report_val=True),
    P.TrainProgress(round=1, units=[P.WorkUnit(id=2, lo=0, hi=64)], steps=2, loss=3.2, samples_per_s=100.0),
    P.AskForMoreWork(round=1),
    P.AssignNext(round=1, units=[P.WorkUnit(id=9, lo=32, hi=64)]),
    P.NoMoreWork(round=1),
    P.MoreWork(round=1),
    P.StopRound(round=1),
    P.BarrierSync(
        round=1,
        samples=64,
        steps=2,
        loss=None,
        trained=[P.WorkUnit(id=1, lo=0, hi=64)],
        returned=[P.WorkUnit(id=9, lo=32, hi=64)],
        val_loss=2.5,
        val_samples=8,
    ),
    P.BarrierReady(round=1, order=[A], samples=[8]),
    P.BarrierReady(round=1, order=[A, B], samples=[8, 0], bound=1.5),
    P.BarrierReady(round=1, samples=[8, 16]),
    P.RoundDone(round=1, checksum="c"),
    P.RoundDone(round=1, ring_epoch=2, checksum="c", announced=True, before="b"),
    P.RoundDone(round=1, checksum="c", heard=[P.Heard(owner=A, digest="d" * 64, sig="5" * 128)]),
    P.Commit(round=1, ring_epoch=2),
    P.RingFailed(round=1, ring_epoch=2, reason="gone"),
    P.EvalResult(after_round=1, val_loss=2.0, val_samples=8),
    P.ShardAssignment(
        round=2, epoch=0, units=[], role="evaluate", state=P.StateSource(round=1, checksum="c", tickets=["t"])
    ),
    P.Agreed(round=1, abandoned=True, state=P.StateSource(round=0, checksum="c", tickets=["t"])),
    P.TrainConfig(run_id="r", recipe={}, data=P.DataSource(root="ab", size=100, tickets=["t"])),
    P.DataReport(kind="bad_chunk", round=2, samples=3, holder=A, reason="3 samples failed their digest"),
    P.HolderReport(round=2, holder=A, reason="a piece of round 2 that is not the swarm's"),
    P.DataHolders(tickets=["t", "u"]),
    P.NodeLog(step=12, metrics={"loss": 2.5, "acc/top1": 0.5}),
    P.TrainComplete(rounds=3, final_val_loss=1.0),
]


@pytest.mark.parametrize("msg", SAMPLES, ids=lambda m: m.type)
def test_round_trip(msg) -> None:
    assert P.decode(P.encode(msg)) == msg


def test_the_round_trip_covers_every_message() -> None:
    """A message added to protocol.Message without a sample above fails here."""
    union = typing.get_args(typing.get_args(P.Message)[0])
    assert {cls.__name__ for cls in union} == {type(m).__name__ for m in SAMPLES}


@pytest.mark.parametrize(
    "frame,needle",
    [
        (b"\xff\xfe", "not JSON"),
        (b'{"v": %d, "type": "Ping"' % P.SCHEMA_VERSION, "not JSON"),  # truncated
        (b"[1,2]", "not a JSON object"),
        (b'{"v": 99, "type": "Ping"}', "schema version 99"),
        (b'{"v": %d, "type": "Launch"}' % P.SCHEMA_VERSION, "type"),
        (b'{"v": %d, "type": "AssignNext", "round": 1}' % P.SCHEMA_VERSION, "units"),
        (b'{"v": %d, "type": "AssignNext", "round": 1, "units": []}' % P.SCHEMA_VERSION, "units"),  # a grant of nothing
        (
            b'{"v": %d, "type": "AssignNext", "round": 1, "units": [{"id": -1, "lo": 0, "hi": 1}]}' % P.SCHEMA_VERSION,
            "units.0.id",
        ),
        (b'{"v": %d, "type": "AssignNext", "round": "x", "units": [1]}' % P.SCHEMA_VERSION, "round"),
        (b'{"v": %d, "type": "Ping", "evil": 1}' % P.SCHEMA_VERSION, "evil"),
    ],
)
def test_malformed_frames_raise_protocol_error(frame: bytes, needle: str) -> None:
    with pytest.raises(P.ProtocolError) as e:
        P.decode(frame)
    assert needle in str(e.value)


def test_frames_carry_the_schema_version() -> None:
    assert json.loads(P.encode(P.Ping()))["v"] == P.SCHEMA_VERSION


# --- everything from the network is bounded -----------------------------------------------------


def _frame(**fields) -> bytes:
    return json.dumps({"v": P.SCHEMA_VERSION, **fields}).encode()


UNIT = {"id": 1, "lo": 0, "hi": 8}


@pytest.mark.parametrize(
    "frame,needle",
    [
        # deep JSON: used to raise RecursionError out of decode
        (
            b'{"v": %d,"type":"Ping","nonce":' % P.SCHEMA_VERSION + b"[" * 100_000 + b"]" * 100_000 + b"}",
            "nested more than",
        ),
        (b"[" * 50 + b"]" * 50, "not a JSON object"),
        (
            _frame(type="TrainConfig", run_id="r", recipe={"a": json.loads("[" * 40 + "1" + "]" * 40)}),
            "nested more than",
        ),
        (_frame(type="TrainingReady", nodes=[], signatures=[{}] * 100_001), "more than 100000 values"),
        (
            b'{"v": %d,"type":"Ping","nonce":' % P.SCHEMA_VERSION + b"9" * 5000 + b"}",
            "not JSON",
        ),  # an int of 5000 digits
        (
            (
                b'{"v": %d,"type":"TrainProgress","round":0,"units":[{"id":1,"lo":0,"hi":8}],"steps":1,"loss":NaN,'
                b'"samples_per_s":1}' % P.SCHEMA_VERSION
            ),
            "NaN",
        ),
        (
            b'{"v": %d,"type":"EvalResult","after_round":0,"val_loss":1e999,"val_samples":1}' % P.SCHEMA_VERSION,
            "too large",
        ),
        (b'{"v": %d,"type":"RoundDone","round":0,"checksum":"c","reduce_s":-Infinity}' % P.SCHEMA_VERSION, "-Infinity"),
        (b'{"v": %d,"type":"TrainingCancel","reason":"\xff"}' % P.SCHEMA_VERSION, "not JSON"),
        # WorkUnit: lo <= hi, both bounded (a negative size used to skew every node's weight)
        (_frame(type="AssignNext", round=0, units=[{"id": 1, "lo": 50, "hi": 3}]), "lo 50 > hi 3"),
        (_frame(type="AssignNext", round=0, units=[{"id": 1, "lo": 0, "hi": 2**40}]), "units.0.hi"),
        (_frame(type="TrainProgress", round=0, units=[], steps=1, loss=1.0, samples_per_s=1.0), "units"),
        (_frame(type="BarrierSync", round=0, samples=-5, steps=1, loss=1.0), "samples"),
        (_frame(type="BarrierSync", round=0, samples=0, steps=1, loss=1.0, trained=[UNIT]), "samples 0 is not the 8"),
        (_frame(type="BarrierSync", round=0, samples=8, steps=1, loss=1.0, trained=[0] * 70_000), "trained"),
        # ranges
        (_frame(type="Heartbeat", round=-2), "round"),
        (_frame(type="AskForMoreWork", round=2**40), "round"),
        (_frame(type="ShardAssignment", round=0, epoch=-1, units=[]), "epoch"),
        (_frame(type="RingFailed", round=0, ring_epoch=-1, reason="x"), "ring_epoch"),
        (_frame(type="TrainProgress", round=0, units=[UNIT], steps=1, loss=1.0, samples_per_s=-1.0), "samples_per_s"),
        (_frame(type="RoundDone", round=0, checksum="c", bytes_sent=-1), "bytes_sent"),
        (_frame(type="BarrierReady", round=0, order=[A], samples=[-1]), "samples"),
        (_frame(type="BarrierReady", round=0, order=[A, A], samples=[1, 1]), "twice"),
        (_frame(type="BarrierReady", round=0, order=[A, B], samples=[1]), "2 members in the ring but 1"),
        (_frame(type="BarrierReady", round=0, samples=[]), "samples"),
        (_frame(type="BarrierReady", round=0, order=[], samples=[1]), "order"),
        (_frame(type="BarrierReady", round=0, samples=[1], bound=-1.0), "bound"),
        # strings: ids, tickets, tokens
        (_frame(type="NodeInfo", node_id="A" * 64, name="n", backend="b", device="d", ring_ticket="t"), "node_id"),
        (_frame(type="NodeInfo", node_id=A, name="n", backend="b", device="d", ring_ticket="t" * 5000), "ring_ticket"),
        (_frame(type="NodeInfo", node_id=A, name="n", backend="b", device="d", ring_ticket="two words"), "ring_ticket"),
        (_frame(type="NodeInfo", node_id=A, name=7, backend="b", device="d", ring_ticket="t"), "name"),
        (_frame(type="TrainingReady", nodes=["x"]), "nodes"),
        (_frame(type="TrainingReady", nodes=[A] * 1025), "nodes"),
        (_frame(type="TrainingReady", nodes=[A], signatures=[{"node_id": {"nested": 1}}]), "signatures"),
        (_frame(type="RoundDone", round=0, checksum="c" * 300), "checksum"),
        (
            _frame(type="RoundDone", round=0, checksum="c", heard=[{"owner": A, "digest": "d" * 63, "sig": "5" * 128}]),
            "heard",
        ),
        (
            _frame(type="RoundDone", round=0, checksum="c", heard=[{"owner": A, "digest": "d" * 64, "sig": "X" * 128}]),
            "heard",
        ),
        (
            _frame(
                type="RoundDone",
                round=0,
                checksum="c",
                heard=[{"owner": A, "digest": "d" * 64, "sig": "5" * 128}] * 1025,
            ),
            "heard",
        ),
        (_frame(type="RoundDone", round=0, checksum="\u001b[31m"), "checksum"),
        (
            _frame(
                type="RepoCommit",
                repo="r\nfake",
                commit="c",
                tree="t",
                node_id=A,
                timestamp=1.0,
                nonce="n",
                param_checksum="p",
                n_train=1,
            ),
            "repo",
        ),
    ],
    ids=lambda x: x if isinstance(x, str) else "",
)
def test_hostile_frames_raise_short_protocol_errors(frame: bytes, needle: str) -> None:
    with pytest.raises(P.ProtocolError) as e:
        P.decode(frame)
    assert needle in str(e.value)
    assert len(str(e.value)) <= 300 and str(e.value).isprintable()


def test_a_round_done_at_its_bounds_fits_a_control_frame() -> None:
    # what a node of a swarm of MAX_NODES reports: every other member's digest and signature
    others = [f"{i:064x}" for i in range(P.MAX_NODES)]
    full = P.RoundDone(
        round=P.MAX_ROUND,
        checksum="c" * 64,
        outliers=others,
        heard=[P.Heard(owner=i, digest="d" * 64, sig="5" * 128) for i in others],
    )
    frame = P.encode(full)
    assert len(frame) <= MAX_CONTROL_FRAME and P.decode(frame) == full


def test_errors_quote_hostile_input_as_plain_text() -> None:
    with pytest.raises(P.ProtocolError) as e:
        P.decode(_frame(type="\x1b[2J" + "X" * 10_000))
    assert "\\x1b[2J" in str(e.value) and "\x1b" not in str(e.value)
    assert len(str(e.value)) <= 300


def test_text_for_people_is_made_plain_and_capped() -> None:
    info = P.decode(
        _frame(
            type="NodeInfo",
            node_id=A,
            name="[/x] \x1b[31mred\x1b[0m\nnext\u202e",
            backend="b" * 500,
            device="[bold]cpu[/bold]",
            ring_ticket="t",
        )
    )
    assert info.name == "[/x] \\x1b[31mred\\x1b[0m\\nnext\\u202e"  # markup kept literally, controls escaped
    assert len(info.backend) == P.MAX_NAME and info.backend.endswith("…")
    assert info.device == "[bold]cpu[/bold]"
    cancel = P.TrainingCancel(reason="line one\nline two" + "x" * 5000)  # our own long reasons never fail
    assert cancel.reason.startswith("line one\\nline two") and len(cancel.reason) == P.MAX_TEXT


@pytest.mark.parametrize(
    "text,cap,want",
    [
        ("plain", 10, "plain"),
        ("[/x]", 10, "[/x]"),
        ("\x1b[31mred", 20, "\\x1b[31mred"),
        ("a\nb\rc\td", 20, "a\\nb\\rc\\td"),
        ("\ud800", 20, "\\ud800"),
        ("x" * 50, 10, "x" * 9 + "…"),
        ("\x00" * 50, 10, "\\x00\\x00…"),
        ("ab\x1b", 5, "ab…"),  # never half an escape
        (ValueError("bad\nthing"), 20, "bad\\nthing"),
    ],
)
def test_printable(text: object, cap: int, want: str) -> None:
    assert P.printable(text, cap) == want


def test_random_and_mutated_frames_only_ever_raise_protocol_error() -> None:
    """Thousands of hostile frames: random bytes, truncations, bit flips and spliced garbage of
    real frames. decode returns a valid message or raises ProtocolError, nothing else."""
    rng = random.Random(13)
    valid = [P.encode(m) for m in SAMPLES]
    junk = [
        b"[",
        b"{",
        b"]",
        b"}",
        b'"',
        b"\\",
        b"\xff",
        b"\x00",
        b"NaN",
        b"1e999",
        b"-",
        b"null",
        b"\\ud800",
        b'{"v":1}',
        b'"type":"Ping"',
        b"9" * 30,
    ]
    decoded = 0
    for i in range(6000):
        base = bytearray(rng.choice(valid))
        kind = i % 4
        if kind == 0:
            frame = bytes(rng.getrandbits(8) for _ in range(rng.randrange(0, 64)))
        elif kind == 1:
            frame = bytes(base[: rng.randrange(0, len(base))])
        elif kind == 2:
            for _ in range(rng.randrange(1, 4)):
                base[rng.randrange(len(base))] = rng.getrandbits(8)
            frame = bytes(base)
        else:
            at = rng.randrange(len(base))
            frame = bytes(base[:at]) + rng.choice(junk) * rng.choice((1, 2, 7, 40, 2000)) + bytes(base[at:])
        try:
            P.decode(frame)
            decoded += 1
        except P.ProtocolError as e:
            assert str(e).isprintable() and len(str(e)) <= 300
    assert decoded < 6000  # most of them are garbage, and were refused as such


@pytest.mark.parametrize(
    "metrics,needle",
    [
        ({f"m{i}": 1.0 for i in range(P.MAX_METRICS + 1)}, "metrics"),  # a few keys, not a flood
        ({"loss": "NaN"}, "metrics"),
        ({"x" * 33: 1.0}, "metrics"),
        ({"a b": 1.0}, "metrics"),
    ],
)
def test_a_node_log_is_bounded(metrics: dict, needle: str) -> None:
    frame = json.dumps({"v": P.SCHEMA_VERSION, "type": "NodeLog", "step": 1, "metrics": metrics}).encode()
    with pytest.raises(P.ProtocolError, match=needle):
        P.decode(frame)


def test_a_barrier_ready_spells_its_ring_out_from_the_order_it_names_or_the_last_one() -> None:
    named = P.decode(P.encode(P.BarrierReady(round=1, order=[A, B], samples=[24, 8])))
    assert [(m.node_id, m.weight) for m in named.members(None)] == [(A, 0.75), (B, 0.25)]
    same = P.decode(P.encode(P.BarrierReady(round=2, samples=[0, 8])))  # "the order you were sent last"
    assert [(m.node_id, m.weight) for m in same.members([A, B])] == [(A, 0.0), (B, 1.0)]
    for told in (None, [A]):  # a node that was never sent an order, or another one: a clear error
        with pytest.raises(P.ProtocolError, match="2 sample counts"):
            same.members(told)
