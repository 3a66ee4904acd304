"""Control-plane messages (ALPN ``drift/0``): one typed model per message, one encode/decode path.

A frame body is UTF-8 JSON ``{"v": SCHEMA_VERSION, "type": "<Name>", ...fields}``. Tensors never
travel here (the ring has its own binary framing in ring.py). Decoding validates every field, so
a malformed or unexpected message raises ProtocolError and the caller drops that connection.

Everything here comes from the network, so every field has bounds: ids are 64 hex characters,
tickets and tokens (checksums, nonces, commits) short runs of printable ASCII, counts and round
numbers non-negative integers under a cap, lists of units or nodes capped in length, numbers
finite (JSON has no NaN or Infinity), and a frame at most MAX_DEPTH levels deep and MAX_VALUES
values big. Free text meant for people (names, devices, reasons) is made plain by `printable`
as it is decoded: control characters (ANSI escapes, newlines) escaped, length capped. Shown
anywhere, it is plain text, never markup.
"""

from __future__ import annotations

import json
import math
from typing import Annotated, Any, Literal

from pydantic import (
    AfterValidator,
    BaseModel,
    ConfigDict,
    Field,
    StrictBool,
    StrictFloat,
    StrictInt,
    StrictStr,
    StringConstraints,
    TypeAdapter,
    ValidationError,
    model_validator,
)

# 2: content-addressed checksums (drift-state/1), BarrierReady.slack_s, HolderReport; 3: TrainProgress.ask;
# 4: Heard.level, RingFailed.level (the sparse rule's hierarchy); 5: nodes present their RepoCommit to each
# other on every connection (drift/peers.py), TrainingReady carries auth_threshold's few, MembersChanged,
# Agreed.keep (rounds that close at a quorum); 6: the dense ring runs as a grid from GRID_FROM members
# (drift/ring.py), Forgery.level; 7: Tickets (BarrierReady names members by id), Forgery.part, a grid row's
# all-gather forwards its column owners' signed chunks; 8: BarrierReady names the ring's order only when it
# changed, and carries samples and a norm bound in place of every member's weight and norm; 9: no_more,
# MoreWork; 10: BarrierReady.flat (the grid gives way to the flat ring after a failure nobody was named for);
# 11: AssignNext.units and TrainProgress.units (a grant and a report may hold several units)
SCHEMA_VERSION = 11

# Bounds on what a peer may send. Generous for any real swarm, small enough that no frame can
# make the receiver do much work or hold much memory.
MAX_NODES = 1024  # nodes in a swarm: TrainingReady.nodes, ring members, signatures
MAX_UNITS = 65536  # work units in one message (the 1 MiB frame cap binds first anyway)
MAX_ROUND = 2**31 - 1  # rounds, epochs, ring epochs (the ring header carries round as uint32)
MAX_COUNT = 2**53  # samples, steps, bytes: integers JSON carries exactly
MAX_UNIT_SAMPLES = 2**31 - 1  # WorkUnit.hi: samples within one unit
MAX_RATE = 1e12  # samples/s
MAX_SECONDS = 1e9  # durations
MAX_NAME = 64  # node names, devices, backends (HOST_NAME_MAX is 64)
MAX_TEXT = 1000  # reasons and other free text
JOIN_BUSY = "busy, try again"  # how a refusal for now begins: the coordinator's joining slots are full
MAX_TICKET = 4096  # an iroh ticket: ~77 characters on loopback, more with many addresses
MAX_TOKEN = 256  # checksums, nonces, run ids, commits, signatures
MAX_PATH = 4096  # repo URLs and paths
MAX_DEPTH = 32  # JSON nesting of a whole frame (a recipe's task_config included)
MAX_VALUES = 100_000  # JSON values in a whole frame


class ProtocolError(Exception):
    """A frame that is not a valid drift message of this schema version."""


def printable(s: object, cap: int = 200) -> str:
    """`s` as one line of plain text at most `cap` characters long: every character that is not
    printable (control characters such as ESC or newline, bidi overrides, lone surrogates) is
    shown as its escape (``\\x1b``, ``\\n``, ``\\u202e``); a cut ends in '…'. Use it wherever
    text from the network is logged or displayed."""
    text = s if isinstance(s, str) else str(s)
    if len(text) <= cap and text.isprintable():
        return text
    out: list[str] = []
    n = 0
    for c in text[: cap + 1]:  # escapes only lengthen it: the rest would be cut anyway
        piece = c if c.isprintable() else c.encode("unicode_escape", "backslashreplace").decode("ascii")
        out.append(piece)
        n += len(piece)
        if n > cap:
            break
    if n <= cap:
        return "".join(out)
    while n > cap - 1:  # cut whole characters (never half an escape), then mark the cut
        n -= len(out.pop())
    return "".join(out) + "…"


def _plain(cap: int) -> AfterValidator:
    return AfterValidator(lambda s: printable(s, cap))


def _no_control(s: str) -> str:
    if not s.isprintable():
        raise ValueError("contains control or other non-printable characters")
    return s


# Free text for people: made plain and capped on the way in (never refused for its content).
Name = Annotated[StrictStr, _plain(MAX_NAME)]
Text = Annotated[StrictStr, _plain(MAX_TEXT)]
# Machine strings: refused unless well-formed.
NodeId = Annotated[StrictStr, StringConstraints(pattern=r"^[0-9a-f]{64}$")]
Ticket = Annotated[StrictStr, StringConstraints(min_length=1, max_length=MAX_TICKET, pattern=r"^[!-~]+$")]
Token = Annotated[StrictStr, StringConstraints(max_length=MAX_TOKEN, pattern=r"^[!-~]*$")]
PathText = Annotated[StrictStr, StringConstraints(max_length=MAX_PATH), AfterValidator(_no_control)]
Round = Annotated[int, Field(ge=0, le=MAX_ROUND)]
RoundOrInitial = Annotated[int, Field(ge=-1, le=MAX_ROUND)]  # -1: before round 0 (the initial θ)
Count = Annotated[int, Field(ge=0, le=MAX_COUNT)]
Rate = Annotated[float, Field(ge=0, le=MAX_RATE)]
Seconds = Annotated[float, Field(ge=0, le=MAX_SECONDS)]
Loss = float  # finite on the wire (decode refuses NaN and Infinity); a diverged node may compute NaN
MAX_METRICS = 16
MetricName = Annotated[StrictStr, StringConstraints(min_length=1, max_length=32, pattern=r"^[A-Za-z0-9_./-]+$")]
Metrics = Annotated[dict[MetricName, float], Field(max_length=MAX_METRICS)]  # a task's metrics(model, batch)
# A signed RepoCommit as TrainingReady forwards it: one flat object of scalars (auth/ verifies it).
SignedField = StrictBool | StrictInt | StrictFloat | Annotated[StrictStr, StringConstraints(max_length=MAX_PATH)] | None
Signed = Annotated[dict[Annotated[StrictStr, StringConstraints(max_length=64)], SignedField], Field(max_length=32)]


class _Msg(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


# --- handshake ---------------------------------------------------------------------------------


class NodeInfo(_Msg):
    """Node -> coordinator, first message: who I am and what I bring."""

    type: Literal["NodeInfo"] = "NodeInfo"
    node_id: NodeId
    name: Name
    backend: Name  # "torch", "mlx", "numpy"
    device: Name  # "cpu", "cuda:0", "mps", ...
    device_name: Text = ""
    ring_ticket: Ticket  # where ring neighbours reach this node (drift-ring/0)
    samples_per_s: Rate | None = None  # calibrated on the real task; None until measured
    run: Token | None = None  # the run its join ticket names (None: a bare endpoint ticket)


class TrainConfig(_Msg):
    """Coordinator -> node: the run to join."""

    type: Literal["TrainConfig"] = "TrainConfig"
    run_id: Token
    recipe: dict[str, Any]  # the validated recipe (see recipe.py), as plain data
    commit: Token | None = None  # repo commit every node must run
    base: BaseSource | None = None  # recipe init_weights: θ₀ and/or the frozen base, from the coordinator
    data: DataSource | None = None  # the task's samples, for a node that lacks them (recipe data:)


class RepoCommit(_Msg):
    """Node -> coordinator: the code I loaded, signed with my node key (auth/ checks it)."""

    type: Literal["RepoCommit"] = "RepoCommit"
    repo: PathText
    commit: Token | None
    tree: Token | None
    node_id: NodeId
    timestamp: Annotated[float, Field(ge=0, le=1e11)]
    nonce: Token
    signature: Token = ""  # hex Ed25519 over every other field (auth.repo_commit)
    param_checksum: Token  # checksum of the initial θ this node built
    frozen_checksum: Token = ""  # digest of its frozen parameters (a LoRA base; "" for none)
    n_train: Count  # training samples in the task this node loaded
    n_params: Count = 0  # values in θ: bounds what a state transfer may send
    layout: Token = ""  # ParamLayout.digest() of θ: a donor's tensor names, shapes and order must match
    run_id: Token = ""  # TrainConfig.run_id: binds the signature to this run
    samples_per_s: Rate | None = None  # calibrated on the loaded task (a few timed inner steps)


class TrainingReady(_Msg):
    """Coordinator -> nodes: the swarm is admitted; rounds start."""

    type: Literal["TrainingReady"] = "TrainingReady"
    nodes: Annotated[list[NodeId], Field(max_length=MAX_NODES)]
    # signed RepoCommits of auth_threshold's few members; each node checks the others' as they first talk
    signatures: Annotated[list[Signed], Field(max_length=MAX_NODES)] = Field(default_factory=list)


class MembersChanged(_Msg):
    """Coordinator -> the members it told the membership before: who joined and who left since
    (a newcomer gets a whole TrainingReady). A join costs the coordinator a few ids to each
    member, not every member's id to each (N² bytes a join)."""

    type: Literal["MembersChanged"] = "MembersChanged"
    joined: Annotated[list[NodeId], Field(max_length=MAX_NODES)] = Field(default_factory=list)
    left: Annotated[list[NodeId], Field(max_length=MAX_NODES)] = Field(default_factory=list)


class Tickets(_Msg):
    """Coordinator -> a member, before a BarrierReady: the tickets of the members it connects to in
    that attempt (its ring, grid or level neighbours) that it has not been told yet. A BarrierReady
    names members by id alone: every member's ticket to every member was N² bytes (150 MB at 1,000)."""

    type: Literal["Tickets"] = "Tickets"
    tickets: Annotated[dict[NodeId, Ticket], Field(max_length=MAX_NODES)]


class TrainingCancel(_Msg):
    """Either side: this node is not (or no longer) part of the run, and why. `retry` tells a node
    that was in the swarm before that it may connect again (its old connection is not gone yet)."""

    type: Literal["TrainingCancel"] = "TrainingCancel"
    reason: Text
    retry: bool = False


# --- liveness ----------------------------------------------------------------------------------


class Ping(_Msg):
    type: Literal["Ping"] = "Ping"
    nonce: Count = 0


class Heartbeat(_Msg):
    type: Literal["Heartbeat"] = "Heartbeat"
    round: RoundOrInitial
    samples_per_s: Rate | None = None
    held: RoundOrInitial | None = None  # the agreed round whose θ this node holds (once it has a model)


# --- work --------------------------------------------------------------------------------------


class WorkUnit(_Msg):
    """Samples [lo, hi) of unit `id` in epoch `epoch`'s order (a unit cut short comes back as a
    tail). A round's units may span two epochs: a small dataset ends mid-round."""

    epoch: Round = 0
    id: int = Field(ge=0, le=MAX_COUNT)
    lo: int = Field(ge=0, le=MAX_UNIT_SAMPLES)
    hi: int = Field(ge=0, le=MAX_UNIT_SAMPLES)

    @model_validator(mode="after")
    def _ordered(self) -> WorkUnit:
        if self.lo > self.hi:  # sizes are hi - lo everywhere: a negative one would skew every weight
            raise ValueError(f"lo {self.lo} > hi {self.hi}")
        return self


Units = Annotated[list[WorkUnit], Field(max_length=MAX_UNITS)]  # (the frame's MAX_VALUES may bind first)
SomeUnits = Annotated[list[WorkUnit], Field(min_length=1, max_length=MAX_UNITS)]


class StateSource(_Msg):
    """Where a node that lacks the swarm's θ fetches it (ALPN drift-state/1), and what to expect."""

    round: RoundOrInitial  # θ after this round's outer step (-1: the initial θ)
    checksum: Token
    tickets: Annotated[list[Ticket], Field(max_length=MAX_NODES + 1)]  # peers that hold it, tried in order


class BaseSource(_Msg):
    """Where a node fetches the weights of recipe init_weights (ALPN drift-base/0): the digest of
    their manifest (each tensor's name, dtype, shape and digest) and their size."""

    root: Token
    size: Count  # bytes of all the tensors
    tickets: Annotated[list[Ticket], Field(min_length=1, max_length=MAX_NODES + 1)]  # holders, tried in order
    theta: bool = True  # the file's trainable tensors are θ₀ (not when resuming: the checkpoint's θ is)


class DataSource(_Msg):
    """Where a node that lacks the task's data fetches its samples (ALPN drift-data/0): the digest
    of the holder's manifest (every sample's digest) and its size."""

    root: Token
    size: Count  # bytes of the manifest
    tickets: Annotated[list[Ticket], Field(min_length=1, max_length=MAX_NODES + 1)]  # holders, tried in order


class DataHolders(_Msg):
    """Coordinator -> nodes: everyone who serves the run's data now (the coordinator first, then
    the nodes that hold a copy), tried in order by a node that lacks it."""

    type: Literal["DataHolders"] = "DataHolders"
    tickets: Annotated[list[Ticket], Field(min_length=1, max_length=MAX_NODES + 1)]


class DataReport(_Msg):
    """Node -> coordinator, about the served data: samples that failed their digest (fetched
    again), no holder able to serve (the node sits out), a holder serving again, or the totals
        fetched so far (after each round); "holds": this node has the holder's very samples (its copy
    matches the manifest) and serves them to other members over drift-data/0."""

    type: Literal["DataReport"] = "DataReport"
    kind: Literal["bad_chunk", "unavailable", "back", "fetched", "holds"]
    round: RoundOrInitial
    samples: Count = 0
    bytes: Count = 0
    evicted: Count = 0  # cache files deleted to stay within the limit
    holder: NodeId | Literal[""] = ""
    reason: Text = ""


class HolderReport(_Msg):
    """Node -> coordinator: a holder of θ sent it, in a fetch of that round, a piece that is not
    the swarm's (its digest differs from the agreed checksum's). One member's word: the
    coordinator passes a holder over once two members named it (Swarm.named_holder)."""

    type: Literal["HolderReport"] = "HolderReport"
    round: RoundOrInitial
    holder: NodeId
    reason: Text = ""


class ShardAssignment(_Msg):
    """Coordinator -> node, at the start of a round: the units granted now, and the role.

    `planned` is how many more units the plan holds for this node; they are granted as it asks
    (AskForMoreWork -> AssignNext), so a faster node can take them instead (work stealing). `no_more`:
    nothing more will be granted to this node after these units (stealing: nothing is left for
    anyone; lockstep: its own plan is granted), so it does not ask, as if told NoMoreWork, until a
    MoreWork says units came back. A round of a thousand nodes with a unit each saves two frames a
    node."""

    type: Literal["ShardAssignment"] = "ShardAssignment"
    round: Round
    epoch: Round
    units: Units
    planned: Count = 0
    no_more: bool = False
    # evaluate: the val loss of the newest agreed θ, no training; wait (overlapped sync): nothing
    # this round, but catch up on the round in flight (a node that needs θ first, e.g. a joiner)
    role: Literal["train", "evaluate", "wait"] = "train"
    report_val: bool = False  # evaluate θ after the outer step and report it in RoundDone
    state: StateSource | None = None  # fetch θ first (late joiners, evaluators)
    progress: Count = 0  # samples the swarm trained before this round (the lr schedule)
    catch_up: Round | None = None  # overlapped sync: a round still being reduced without this node;
    # its θ comes with Agreed, and this node's progress moves along


class TrainProgress(_Msg):
    """Node -> coordinator: units finished, in the order trained (those of the last REPORT_S in one
    frame: drift.inner). Not sent for the units a node ends its round with (drift.rules.reports_ride):
    its BarrierSync lists them, and the coordinator counts them then."""

    type: Literal["TrainProgress"] = "TrainProgress"
    round: Round
    units: SomeUnits
    steps: Count
    loss: Loss | None  # None: the node's loss was not finite (it says so at the barrier)
    samples_per_s: Rate
    ask: bool = False  # ... and an AskForMoreWork with it (one frame instead of two)


class AskForMoreWork(_Msg):
    type: Literal["AskForMoreWork"] = "AskForMoreWork"
    round: Round


class AssignNext(_Msg):
    """Coordinator -> node: the answer to an ask, the units granted now (more than one to a node
    whose measured speed trains one in less than drift.rules.GRANT_S)."""

    type: Literal["AssignNext"] = "AssignNext"
    round: Round
    units: SomeUnits
    no_more: bool = False  # nothing more for this node after it: no asks (as ShardAssignment.no_more)


class NoMoreWork(_Msg):
    type: Literal["NoMoreWork"] = "NoMoreWork"
    round: Round


class MoreWork(_Msg):
    """Coordinator -> node: units came back to the round's plan (a node left, or its work was
    voided) after this node was told nothing was left: ask again."""

    type: Literal["MoreWork"] = "MoreWork"
    round: Round


class StopRound(_Msg):
    """Coordinator -> node: the round's budget is spent; stop at the next inner step."""

    type: Literal["StopRound"] = "StopRound"
    round: Round


# --- barrier and reduce ------------------------------------------------------------------------


class BarrierSync(_Msg):
    """Node -> coordinator: I stopped for this round. `trained` lists exactly the samples that
    went into my θ_local; `returned` the granted samples I did not train (back to the queue)."""

    type: Literal["BarrierSync"] = "BarrierSync"
    round: Round
    samples: Count
    steps: Count
    loss: Loss | None
    trained: Units = Field(default_factory=list)
    returned: Units = Field(default_factory=list)
    val_loss: Loss | None = None  # evaluators: val loss of θ at the start of this round
    val_samples: Count = 0
    metrics: Metrics = Field(default_factory=dict)  # the task's metrics beside val_loss
    delta_error: Text | None = None  # the node's own Δ is unusable (NaN, absurd size): it sends zeros
    busy_s: Seconds = 0.0  # seconds spent in inner steps this round (utilization)
    lr: Annotated[float, Field(ge=0, le=1e6)] = 0.0  # the inner learning rate it trained with
    delta_norm: Norm | None = None  # ||Δ|| of its own (unweighted) pseudo-gradient: bounds the ring's sum

    @model_validator(mode="after")
    def _samples_are_the_trained_ones(self) -> BarrierSync:
        trained = sum(u.hi - u.lo for u in self.trained)
        if self.samples != trained:  # the coordinator averages losses by samples: no 0 or stray count
            raise ValueError(f"samples {self.samples} is not the {trained} samples listed in trained")
        return self


Norm = Annotated[float, Field(ge=0, le=1e30)]  # the L2 norm of a pseudo-gradient (finite)


class RingMember(_Msg):
    """A ring member as a node's collective sees it (BarrierReady.members): who, and its weight."""

    node_id: NodeId
    ticket: Ticket | None = None  # None: the coordinator told this node its ticket before (Tickets)
    weight: Annotated[float, Field(ge=0, le=1)]


class BarrierReady(_Msg):
    """Coordinator -> nodes: the ring for this round. It names the members once: `order` is sent
    when it differs from the last one this node was sent (a member leaves or comes, a retry
    reverses it), else None. The members' weights go as the samples each one counted, and their
    reported Δ norms as the one bound a node checks the sum against: a BarrierReady of every
    member's id, weight and norm to every member was N² bytes a round from the coordinator."""

    type: Literal["BarrierReady"] = "BarrierReady"
    round: Round
    order: Annotated[list[NodeId], Field(min_length=1, max_length=MAX_NODES)] | None = None
    samples: Annotated[list[Count], Field(min_length=1, max_length=MAX_NODES)]  # in ring order
    # Σ weight·reported norm, what the sum's norm may reach (diloco.reduced_problem; None: no check):
    # norms of at most 1e30 under weights summing to 1, and rounding
    bound: Annotated[float, Field(ge=0, le=2e30)] | None = None
    ring_epoch: Round = 0  # bumped on every retry: ring connections of older epochs are stale
    codec: Annotated[StrictStr, StringConstraints(max_length=16)] = "fp32"
    # A ring of two has no majority to outvote a bad θ: its members announce the θ their outer
    # step would give (RoundDone, `announced`) and apply it only on Commit. `recheck`: the attempt
    # redoes one whose announcements disagreed; each also reports the state it steps from (`before`).
    confirm: bool = False
    recheck: bool = False
    # The flat ring even from GRID_FROM members: a grid's later passes name nobody they wait for, so
    # after a grid attempt failed with nobody named the swarm reduces where every wait is evidence.
    flat: bool = False
    # What a member may take beyond the others to send its part before it is named late (the
    # all-gather's relative deadline): two heartbeats, and overlapped one inner step of the
    # slowest member by the coordinator's clock (a member finishes the step in hand first).
    slack_s: Annotated[float, Field(ge=0, le=3600)] = 5.0

    @model_validator(mode="after")
    def _distinct(self) -> BarrierReady:
        if self.order is not None:
            if len(set(self.order)) != len(self.order):
                raise ValueError("a node appears twice in the ring")
            if len(self.order) != len(self.samples):
                raise ValueError(f"{len(self.order)} members in the ring but {len(self.samples)} sample counts")
        return self

    def members(self, told: list[str] | None) -> list[RingMember]:
        """The ring: `order` (or `told`, the last order this node was sent) with each member's
        weight, its samples over all of them. ProtocolError if the two do not fit."""
        order = self.order if self.order is not None else told
        if order is None or len(order) != len(self.samples):
            raise ProtocolError(
                f"BarrierReady of round {self.round} has {len(self.samples)} sample counts for "
                f"{'no ring order' if order is None else f'the {len(order)} members of the last ring order'}"
            )
        # (the ids are checked NodeIds, the weights in [0, 1]: no validation)
        return [RingMember.model_construct(node_id=i, weight=w) for i, w in zip(order, shares(self.samples))]


def shares(counts: list[int]) -> list[float]:
    """Each count over their sum (0 when all are 0): ring members' weights from their counted
    samples, the same floats on the coordinator (rules.weights) and every node."""
    total = sum(counts)
    return [n / total if total else 0.0 for n in counts]


Hex = Annotated[StrictStr, StringConstraints(max_length=128, pattern=r"^([0-9a-f]{2})*$")]


class Forgery(_Msg):
    """A receiver's proof that its left neighbour (`forwarder`) passed on, as a segment owner's
    chunk, bytes that owner did not sign: the forwarder's hop signature over the owner's message
    and signature, which the coordinator checks itself (drift.ring.proves_forgery)."""

    forwarder: NodeId
    round: Round
    generation: Round
    segment: Count
    lo: Count
    hi: Count
    total: Count
    digest: Hex  # sha256 of the payload as received
    owner_sig: Hex
    step: Count
    chunk: Count
    hop_sig: Hex
    level: Annotated[int, Field(ge=0, le=2)] = 0  # of the grid (drift/ring.py, `Grid`); 0: the flat ring
    part: Count = 0  # in a grid: the forwarder's row's segment the chunk is of (ring.signer)


class Heard(_Msg):
    """What a node got from one member in an all-gather: sha256 of the payload and the member's
    signature of it (drift.gather.payload_message), which the coordinator checks itself."""

    owner: NodeId
    digest: Annotated[StrictStr, StringConstraints(pattern=r"^[0-9a-f]{64}$")]
    sig: Annotated[StrictStr, StringConstraints(pattern=r"^[0-9a-f]{128}$")]
    level: Annotated[int, Field(ge=0, le=16)] = 0  # of the hierarchy (drift/hierarchy.py); 0: the owner's own


class RingFailed(_Msg):
    """Node -> coordinator: the all-reduce broke (a neighbour vanished?); waiting for a retry."""

    type: Literal["RingFailed"] = "RingFailed"
    round: Round
    ring_epoch: Round
    reason: Text
    suspect: NodeId | Literal[""] = ""  # the neighbour whose bytes or silence failed it, when known
    sit_out: bool = False  # this node already applied this round's outer step: it cannot redo it
    poisoned: bool = False  # the ring finished, but its sum is larger than the reported norms allow
    proof: Forgery | None = None  # the suspect forwarded bytes their owner did not sign (drift.ring)
    level: Annotated[int, Field(ge=0, le=16)] = 0  # of the hierarchy, where it failed (drift/hierarchy.py)


class RoundDone(_Msg):
    """Node -> coordinator: outer step applied; the checksum of the new θ."""

    type: Literal["RoundDone"] = "RoundDone"
    round: Round
    ring_epoch: Round = 0
    checksum: Token
    val_loss: Loss | None = None
    metrics: Metrics = Field(default_factory=dict)  # the task's metrics beside val_loss
    bytes_sent: Count = 0
    reduce_s: Seconds = 0.0
    check_s: Seconds = 0.0  # of that, the checks: bytes bound to their owner, the sum's bound, a preview
    # sync rules that see every contribution (all-gather): members whose contribution was far
    # outside the others' (or did not decode); the coordinator excludes one a majority names
    outliers: Annotated[list[NodeId], Field(max_length=MAX_NODES)] = Field(default_factory=list)
    # (all-gather) what it got from each other member: two signed digests of one member prove
    # that it sent different payloads (drift.rules.equivocation)
    heard: Annotated[list[Heard], Field(max_length=MAX_NODES)] = Field(default_factory=list)
    announced: bool = False  # (BarrierReady.confirm) the θ the step would give; not applied until Commit
    before: Token = ""  # (BarrierReady.recheck) the checksum of the state this node's step starts from


class Commit(_Msg):
    """Coordinator -> the two members of a ring (BarrierReady.confirm): both announced the same
    θ; apply the outer step now and report it (RoundDone)."""

    type: Literal["Commit"] = "Commit"
    round: Round
    ring_epoch: Round


class EvalResult(_Msg):
    """Evaluator -> coordinator: validation loss of θ after round `after_round`."""

    type: Literal["EvalResult"] = "EvalResult"
    after_round: RoundOrInitial
    val_loss: Loss
    val_samples: Count
    samples_per_s: Rate | None = None  # training speed, estimated from the evaluation's timing
    metrics: Metrics = Field(default_factory=dict)  # the task's metrics beside val_loss


class Agreed(_Msg):
    """Coordinator -> the nodes that did not compute it themselves (not in the ring's last attempt,
    or caught up later): round `round` is settled, and θ is now the state in `state` (the round's,
    or, when the round was given up, the one before: `abandoned`)."""

    type: Literal["Agreed"] = "Agreed"
    round: Round
    abandoned: bool = False
    state: StateSource
    # A node the round went on without (late at the barrier): the share of its own Δ of that round
    # it keeps on top of the new θ (staleness), for its next round's Δ to carry to the swarm.
    keep: float = Field(0.0, ge=0.0, le=1.0)


class TrainComplete(_Msg):
    type: Literal["TrainComplete"] = "TrainComplete"
    rounds: Round
    final_val_loss: Loss | None = None


class NodeLog(_Msg):
    """Node -> coordinator: a user's own loop's metrics (`swarm.log(step=..., loss=...)`), a few
    finite numbers; the coordinator keeps at most one a node every LOG_EVERY_S, and its first of each round."""

    type: Literal["NodeLog"] = "NodeLog"
    step: Count
    metrics: Annotated[dict[MetricName, Annotated[float, Field(allow_inf_nan=False)]], Field(max_length=MAX_METRICS)]


LOG_EVERY_S = 0.5


Message = Annotated[
    NodeInfo
    | TrainConfig
    | RepoCommit
    | TrainingReady
    | MembersChanged
    | Tickets
    | TrainingCancel
    | Ping
    | Heartbeat
    | ShardAssignment
    | TrainProgress
    | AskForMoreWork
    | AssignNext
    | NoMoreWork
    | MoreWork
    | StopRound
    | BarrierSync
    | BarrierReady
    | RingFailed
    | RoundDone
    | Commit
    | EvalResult
    | Agreed
    | DataReport
    | HolderReport
    | DataHolders
    | NodeLog
    | TrainComplete,
    Field(discriminator="type"),
]
_adapter: TypeAdapter[Message] = TypeAdapter(Message)


def encode(msg: _Msg) -> bytes:
    body = msg.model_dump(mode="json")
    body["v"] = SCHEMA_VERSION
    return json.dumps(body, separators=(",", ":")).encode()


def _no_constant(name: str) -> float:
    raise ProtocolError(f"frame carries {name}: drift sends finite numbers only")


def _finite(text: str) -> float:
    x = float(text)
    if not math.isfinite(x):
        raise ProtocolError(f"frame carries the number {printable(text, 40)}, too large for a float")
    return x


def _check_shape(obj: object) -> None:
    """Refuse a frame nested deeper than MAX_DEPTH or holding more than MAX_VALUES values."""
    stack: list[tuple[object, int]] = [(obj, 0)]
    seen = 0
    while stack:
        x, depth = stack.pop()
        seen += 1
        if seen > MAX_VALUES:
            raise ProtocolError(f"frame holds more than {MAX_VALUES} values")
        if isinstance(x, (dict, list)):
            if depth >= MAX_DEPTH:
                raise ProtocolError(f"frame is nested more than {MAX_DEPTH} levels deep")
            stack.extend((v, depth + 1) for v in (x.values() if isinstance(x, dict) else x))


def decode(frame: bytes) -> Message:
    """Decode one frame body, or raise ProtocolError saying (briefly, as plain text) what is wrong
    with it. Whatever the bytes, nothing else escapes."""
    try:
        try:
            obj = json.loads(frame.decode("utf-8"), parse_constant=_no_constant, parse_float=_finite)
        except RecursionError:  # json's parser recurses once per level of nesting
            raise ProtocolError(f"frame is nested more than {MAX_DEPTH} levels deep") from None
        except ValueError as e:  # not UTF-8, not JSON, an integer of thousands of digits
            raise ProtocolError(f"frame is not JSON ({e.__class__.__name__}: {printable(e, 120)})") from None
        if not isinstance(obj, dict):
            raise ProtocolError("frame is not a JSON object")
        # A value takes a byte at least, a level a bracket: most frames are proven in shape uncounted.
        if len(frame) > MAX_VALUES or frame.count(b"{") + frame.count(b"[") > MAX_DEPTH:
            _check_shape(obj)
        v = obj.pop("v", None)
        if v != SCHEMA_VERSION:
            raise ProtocolError(f"schema version {printable(repr(v), 40)}, this drift speaks {SCHEMA_VERSION}")
        try:
            return _adapter.validate_python(obj)
        except ValidationError as e:
            first = e.errors(include_url=False, include_input=False)[0]
            where = ".".join(str(p) for p in first["loc"]) or "message"
            kind = obj.get("type", "message")
            raise ProtocolError(
                printable(f"invalid {kind if isinstance(kind, str) else 'message'}: {where}: {first['msg']}", 300)
            ) from None
    except ProtocolError:
        raise
    except Exception as e:
        raise ProtocolError(f"frame could not be decoded ({e.__class__.__name__}: {printable(e, 120)})") from None
