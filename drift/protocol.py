"""Control-plane messages (ALPN ``drift/0``): one typed model per message, one encode/decode path.

A frame body is UTF-8 JSON ``{"v": SCHEMA_VERSION, "type": "<Name>", ...fields}``. Tensors never
travel here (the ring has its own binary framing in ring.py). Decoding validates every field, so
a malformed or unexpected message raises ProtocolError and the caller drops that connection.
"""

from __future__ import annotations

import json
from typing import Annotated, Any, Literal, Union

from pydantic import BaseModel, ConfigDict, Field, TypeAdapter, ValidationError

SCHEMA_VERSION = 1


class ProtocolError(Exception):
    """A frame that is not a valid drift message of this schema version."""


class _Msg(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


# --- handshake ---------------------------------------------------------------------------------

class NodeInfo(_Msg):
    """Node -> coordinator, first message: who I am and what I bring."""
    type: Literal["NodeInfo"] = "NodeInfo"
    node_id: str
    name: str
    backend: str                      # "torch", "mlx", "numpy"
    device: str                       # "cpu", "cuda:0", "mps", ...
    device_name: str = ""
    ring_ticket: str                  # where ring neighbours reach this node (drift-ring/0)
    samples_per_s: float | None = None  # calibrated on the real task; None until measured


class TrainConfig(_Msg):
    """Coordinator -> node: the run to join."""
    type: Literal["TrainConfig"] = "TrainConfig"
    run_id: str
    recipe: dict[str, Any]            # the validated recipe (see recipe.py), as plain data
    commit: str | None = None         # repo commit every node must run


class RepoCommit(_Msg):
    """Node -> coordinator: the code I loaded, signed with my node key (auth/ checks it)."""
    type: Literal["RepoCommit"] = "RepoCommit"
    repo: str
    commit: str | None
    tree: str | None
    node_id: str
    timestamp: float
    nonce: str
    signature: str = ""               # hex Ed25519 over every other field (auth.repo_commit)
    param_checksum: str               # checksum of the initial θ this node built
    n_train: int                      # training samples in the task this node loaded
    n_params: int = 0                 # values in θ: bounds what a state transfer may send
    run_id: str = ""                  # TrainConfig.run_id: binds the signature to this run
    samples_per_s: float | None = None  # calibrated on the loaded task (a few timed inner steps)


class TrainingReady(_Msg):
    """Coordinator -> nodes: the swarm is admitted; rounds start."""
    type: Literal["TrainingReady"] = "TrainingReady"
    nodes: list[str]
    signatures: list[dict[str, Any]] = Field(default_factory=list)  # each node's signed RepoCommit


class TrainingCancel(_Msg):
    """Either side: this node is not (or no longer) part of the run, and why. `retry` tells a node
    that was in the swarm before that it may connect again (its old connection is not gone yet)."""
    type: Literal["TrainingCancel"] = "TrainingCancel"
    reason: str
    retry: bool = False


# --- liveness ----------------------------------------------------------------------------------

class Ping(_Msg):
    type: Literal["Ping"] = "Ping"
    nonce: int = 0


class Pong(_Msg):
    type: Literal["Pong"] = "Pong"
    nonce: int = 0


class Heartbeat(_Msg):
    type: Literal["Heartbeat"] = "Heartbeat"
    round: int
    samples_per_s: float | None = None


# --- work --------------------------------------------------------------------------------------

class WorkUnit(_Msg):
    """Samples [lo, hi) of unit `id` in the epoch's order (a unit cut short comes back as a tail)."""
    id: int = Field(ge=0)
    lo: int = Field(ge=0)
    hi: int = Field(ge=0)


class StateSource(_Msg):
    """Where a node that lacks the swarm's θ fetches it (ALPN drift-state/0), and what to expect."""
    round: int                        # θ after this round's outer step (-1: the initial θ)
    checksum: str
    tickets: list[str]                # peers that hold it, tried in order


class ShardAssignment(_Msg):
    """Coordinator -> node, at the start of a round: the units granted now, and the role.

    `planned` is how many more units the plan holds for this node; they are granted one at a time
    (AskForMoreWork -> AssignNext), so a faster node can take them instead (work stealing)."""
    type: Literal["ShardAssignment"] = "ShardAssignment"
    round: int
    epoch: int
    units: list[WorkUnit]
    planned: int = 0
    role: Literal["train", "evaluate"] = "train"   # evaluate: val loss of θ at round start, no training
    report_val: bool = False          # evaluate θ after the outer step and report it in RoundDone
    state: StateSource | None = None  # fetch θ first (late joiners, evaluators)


class TrainProgress(_Msg):
    """Node -> coordinator: one unit finished."""
    type: Literal["TrainProgress"] = "TrainProgress"
    round: int
    unit: WorkUnit
    steps: int
    loss: float
    samples_per_s: float


class AskForMoreWork(_Msg):
    type: Literal["AskForMoreWork"] = "AskForMoreWork"
    round: int


class AssignNext(_Msg):
    type: Literal["AssignNext"] = "AssignNext"
    round: int
    unit: WorkUnit


class NoMoreWork(_Msg):
    type: Literal["NoMoreWork"] = "NoMoreWork"
    round: int


class StopRound(_Msg):
    """Coordinator -> node: the round's budget is spent; stop at the next inner step."""
    type: Literal["StopRound"] = "StopRound"
    round: int


# --- barrier and reduce ------------------------------------------------------------------------

class BarrierSync(_Msg):
    """Node -> coordinator: I stopped for this round. `trained` lists exactly the samples that
    went into my θ_local; `returned` the granted samples I did not train (back to the queue)."""
    type: Literal["BarrierSync"] = "BarrierSync"
    round: int
    samples: int
    steps: int
    loss: float | None
    trained: list[WorkUnit] = Field(default_factory=list)
    returned: list[WorkUnit] = Field(default_factory=list)
    val_loss: float | None = None     # evaluators: val loss of θ at the start of this round
    val_samples: int = 0
    delta_error: str | None = None    # the node's own Δ is unusable (NaN, absurd size): it sends zeros


class RingMember(_Msg):
    node_id: str
    ticket: str
    weight: float


class BarrierReady(_Msg):
    """Coordinator -> nodes: the ring for this round (also serves as RingConfig)."""
    type: Literal["BarrierReady"] = "BarrierReady"
    round: int
    ring: list[RingMember]            # ring order; weights sum to 1
    ring_epoch: int = 0               # bumped on every retry: ring connections of older epochs are stale
    codec: str = "fp32"


class RingFailed(_Msg):
    """Node -> coordinator: the all-reduce broke (a neighbour vanished?); waiting for a retry."""
    type: Literal["RingFailed"] = "RingFailed"
    round: int
    ring_epoch: int
    reason: str
    suspect: str = ""                 # the neighbour whose bytes or connection failed, when known


class RoundDone(_Msg):
    """Node -> coordinator: outer step applied; the checksum of the new θ."""
    type: Literal["RoundDone"] = "RoundDone"
    round: int
    ring_epoch: int = 0
    checksum: str
    val_loss: float | None = None
    bytes_sent: int = 0
    reduce_s: float = 0.0


class EvalResult(_Msg):
    """Evaluator -> coordinator: validation loss of θ after round `after_round`."""
    type: Literal["EvalResult"] = "EvalResult"
    after_round: int
    val_loss: float
    val_samples: int
    samples_per_s: float | None = None  # training speed, estimated from the evaluation's timing


class CheckpointInfo(_Msg):
    type: Literal["CheckpointInfo"] = "CheckpointInfo"
    round: int
    path: str
    checksum: str


class TrainComplete(_Msg):
    type: Literal["TrainComplete"] = "TrainComplete"
    rounds: int
    final_val_loss: float | None = None


Message = Annotated[
    Union[NodeInfo, TrainConfig, RepoCommit, TrainingReady, TrainingCancel, Ping, Pong, Heartbeat,
          ShardAssignment, TrainProgress, AskForMoreWork, AssignNext, NoMoreWork, StopRound,
          BarrierSync, BarrierReady, RingFailed, RoundDone, EvalResult, CheckpointInfo, TrainComplete],
    Field(discriminator="type"),
]
_adapter: TypeAdapter[Message] = TypeAdapter(Message)


def encode(msg: _Msg) -> bytes:
    body = msg.model_dump(mode="json")
    body["v"] = SCHEMA_VERSION
    return json.dumps(body, separators=(",", ":")).encode()


def decode(frame: bytes) -> Message:
    """Decode one frame body, or raise ProtocolError saying what is wrong with it."""
    try:
        obj = json.loads(frame.decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ProtocolError(f"frame is not JSON ({e.__class__.__name__}: {e})") from None
    if not isinstance(obj, dict):
        raise ProtocolError("frame is not a JSON object")
    v = obj.pop("v", None)
    if v != SCHEMA_VERSION:
        raise ProtocolError(f"schema version {v!r}, this drift speaks {SCHEMA_VERSION}")
    try:
        return _adapter.validate_python(obj)
    except ValidationError as e:
        first = e.errors()[0]
        where = ".".join(str(p) for p in first["loc"]) or "message"
        raise ProtocolError(f"invalid {obj.get('type', 'message')!s}: {where}: {first['msg']}") from None
