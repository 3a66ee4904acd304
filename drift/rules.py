"""The round's rules as pure decisions over one record per node: who is in the ring, when the
barrier opens, who is overdue, who stops early, who disagrees with the majority, whom both ring
neighbours caught, who sent different payloads to different members. No clocks, no I/O: the
caller (drift.round) passes times in and acts on the answer, and tests/test_rules.py checks each
rule in milliseconds.
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Callable, Collection, Hashable, Iterable, Mapping, Set
from dataclasses import dataclass, field
from typing import Literal

from drift import protocol as P

Role = Literal["train", "evaluate", "wait", "late"]
# train: in this round's barrier and ring (unless it sits out); evaluate: too slow to train, it
# evaluates θ; wait: needs θ first while the round before is still reduced (overlapped sync);
# late: entered after the round started, only told how the round ended (catching up).


SPEED_WINDOW_S = 0.05  # the shortest time a speed is measured over: the coordinator's clock is no finer under load
AHEAD_S = 0.25  # a node may hold granted work it has not reported trained worth this long at its measured speed
GRANT_S = 0.025  # one grant covers this long of a node's work at its measured speed (units shorter: several)


@dataclass
class NodeRound:
    """What one node did in one round, as the coordinator saw it."""

    role: Role
    last_progress: float = 0.0  # when it last showed progress (a grant, a finished unit)
    t_unit: float = 0.0  # since when its unmeasured samples have been in the works (start, last measurement)
    unmeasured: int = 0  # samples of units finished since t_unit, not yet in a speed measurement
    trained: int = 0  # samples of its granted units it reported trained so far (TrainProgress)
    units_after_stop: int = 0  # units it reported after it was told StopRound (the budget handed out, or the tail)
    synced: P.BarrierSync | None = None  # its report at the barrier
    t_sync: float = 0.0
    done: P.RoundDone | None = None  # its θ after the outer step (this ring epoch)
    excluded: bool = False  # weight 0 this round: its work is redone by others
    sitting_out: bool = False  # not in the ring: it gets θ from a peer when the round settles
    early: bool = False  # told to stop ahead of the others (tail)
    catching_up: bool = False  # not in this round's ring: told what θ became when it settles
    late_cut: bool = False  # still out when the quorum went on (quorum_cut): its work merges into the next round
    behind: bool = False  # in the ring, but it did not report θ in time: the round settles without it
    reported: list[tuple[int, int, int, int]] = field(default_factory=list)  # units it reported trained (once each)
    repeated: bool = False  # it reported samples twice this round (named and struck once)
    ask_held: bool = False  # it asked while holding its allowance: answered once its progress shows room

    @property
    def counted(self) -> bool:
        """Its barrier report counts (synced, not excluded)."""
        return self.synced is not None and not self.excluded

    def reported_any(self, u: P.WorkUnit) -> bool:
        """It reported trained some of unit u's samples already."""
        return any(e == u.epoch and k == u.id and lo < u.hi and u.lo < hi for e, k, lo, hi in self.reported)

    def measure(self, samples: int, now: float) -> float | None:
        """Count a finished unit of `samples`; the node's speed by our clock (samples over time
        since the last measurement) once SPEED_WINDOW_S has passed, else None. Reports that queued
        up on the way arrive together: two a millisecond apart would read as a node 1000x faster
        (and every other node would evaluate), so they are measured with the ones after."""
        self.unmeasured += samples
        dt = now - self.t_unit
        if dt < SPEED_WINDOW_S or self.unmeasured <= 0:
            return None
        sps, self.unmeasured, self.t_unit = self.unmeasured / dt, 0, now
        return sps


Records = Mapping[str, NodeRound]


BARRIER_SHARE = 0.01  # the slowdown a node may show the coordinator's clock to save a frame


def reports_ride(barrier_s: float | None, unreported_s: float, waits: bool) -> bool:
    """A node's reports of the units it ended its round with go in its BarrierSync alone (one
    frame a node less; the coordinator counts them when it comes), unless that comes late enough
    to make the node look slower than it is, since the coordinator times progress by its own clock
    from the report before: it waits for the round in flight (overlapped), or the last round's Δ
    (`barrier_s`: last step to BarrierSync; None: none yet) took more than BARRIER_SHARE of the
    time these units took (`unreported_s`: since its last report, or the round's start)."""
    return not waits and barrier_s is not None and barrier_s <= BARRIER_SHARE * unreported_s


def checkpoint_owed(skipped: int | None, newest: int, last: int | None, failed: bool) -> int | None:
    """The round whose checkpoint a run that ends must still write, or None: the newest agreed
    round, when a checkpoint came due while an earlier one was being written (`skipped`: the
    newest such round; rounds shorter than a save) and none as new was written since. None when
    the run is stopping or a save already failed (a full disk would only fail again)."""
    if skipped is None or failed or newest < 0:
        return None
    return newest if newest > (last if last is not None else -1) else None


def checkpoint_instead(failed_round: int, newest: int, tries: int, failed: bool) -> int | None:
    """When the checkpoint of `failed_round` could not be fetched, the round to checkpoint in its
    place: the newest agreed one, if newer. Its holders serve a round only until their next outer
    step, and a coordinator that asks late (busy, or a round settled late after a retry) finds
    them on a newer round: a checkpoint due is then written a round or two late, not skipped.
    None after CHECKPOINT_TRIES tries (`tries` so far), when no round is newer, or when the run is
    stopping or its dir failed (`failed`)."""
    if failed or tries >= CHECKPOINT_TRIES or newest <= failed_round:
        return None
    return newest


CHECKPOINT_TRIES = 3  # rounds tried for one checkpoint due: its own, then the newest agreed


def ask_allowance(unit_samples: int, measured_sps: float | None) -> int:
    """The samples a node may hold granted but not yet reported trained: two units (one in
    training, one asked ahead), or what our clock measured it trains in AHEAD_S if that is more
    (units shorter than a round trip would leave a fast node idle between grants). Its own word
    on its speed gives it nothing: an unmeasured node gets two units."""
    return max(2 * unit_samples, _worth(measured_sps, AHEAD_S))


def grant_units(unit_samples: int, measured_sps: float | None, left: int, members: int) -> int:
    """How many units to grant a node at one ask: the whole units our clock measured it trains
    in GRANT_S (units of a few milliseconds would cost a frame each way every few milliseconds:
    the coordinator's CPU, and the node's next to its training), but no more than an even share
    of the `left` samples not yet granted among the round's `members` (the round's end hands
    back what nodes hold), and at least one. An unmeasured node gets one unit."""
    share = left // max(1, members)
    return max(1, min(_worth(measured_sps, GRANT_S), share) // unit_samples)


def _worth(measured_sps: float | None, seconds: float) -> int:
    """The samples a node trains in `seconds` at the speed our clock measured (0: not measured)."""
    return int(measured_sps * seconds) if measured_sps is not None and math.isfinite(measured_sps) else 0


def samples(units: list[P.WorkUnit]) -> int:
    return sum(u.hi - u.lo for u in units)


def part(recs: Records) -> list[str]:
    """The nodes in this round's barrier and ring, in the records' order."""
    return [i for i, r in recs.items() if takes_part(r)]


def takes_part(r: NodeRound) -> bool:
    """Whether a node is in its round's barrier and ring: it trains, and does not sit it out."""
    return r.role == "train" and not r.sitting_out


def counted(recs: Records, ring: list[str]) -> dict[str, int]:
    """Each ring member's counted samples (0 when excluded): what its weight is made of."""
    return {i: samples(recs[i].synced.trained) if recs[i].counted else 0 for i in ring}


def weights(recs: Records, ring: list[str]) -> dict[str, float]:
    """Each ring member's weight: its counted samples over all counted samples (0 when excluded);
    a node works them out from the same counts (BarrierReady.members)."""
    n = counted(recs, ring)
    return dict(zip(n, P.shares(list(n.values()))))


@dataclass(frozen=True)
class BarrierDecision:
    action: Literal["wait", "abandon", "ring"]
    stragglers: tuple[str, ...] = ()  # excluded and never synced: they sit this round out


def barrier(recs: Records) -> BarrierDecision:
    """The barrier opens once every node in it synced or was excluded (a missed deadline); with
    no usable work at all the round is abandoned. Raises RoundError-worthy ValueError when empty."""
    members = part(recs)
    if not members:
        raise ValueError("every training node has left")
    unsynced = [i for i in members if recs[i].synced is None]
    if any(not recs[i].excluded for i in unsynced):
        return BarrierDecision("wait")
    if not any(recs[i].counted for i in members):
        return BarrierDecision("abandon")
    return BarrierDecision("ring", tuple(unsynced))


CLOCK_S_PER_NODE = 100e-6  # seconds between two runs of a round's clocks, per member of the swarm


def clock_interval(members: int) -> float:
    """Seconds between two runs of a round's clocks (deadlines, the tail, the barrier, silence),
    which look at every node: they run after the events that came meanwhile, at most this often,
    so their cost stays a fixed share of the coordinator's time at any N (a run per event, as the
    events of a thousand nodes trickle in one by one, was N² a round; a run takes about 3 µs a
    node, so this is ~3 % of a core). Eight nodes: every 0.8 ms; a thousand: every 0.1 s, on
    rounds of seconds and deadlines of heartbeats."""
    return members * CLOCK_S_PER_NODE


BEATS_PER_S = 50.0  # beats a second a coordinator hears from all its members (and pings), at most


def quiet_limit(heartbeat_s: float, stale_after_s: float, members: int = 0) -> float:
    """How long a control channel may stay quiet before the next beat sends a frame on it (a
    node's Heartbeat, the coordinator's Ping). Beats come every heartbeat_s, so the other end
    hears from us within max(1.5 beats, stale_after_s / 2): half its patience to spare. A round of
    a thousand nodes is quiet for tens of seconds while they all-reduce, and a beat at half a
    heartbeat was a frame each way per node a round.

    `members`: how many the swarm's members were last told it has. Above BEATS_PER_S beats a
    second in all the limit grows with them (by doublings, so both ends change it seldom): at the
    defaults from 129 members on; a thousand members beat every 20.5 s where every 3 s was 333
    Heartbeats and as many Pings a second through the coordinator."""
    grown = 2 ** math.ceil(math.log2(members)) / BEATS_PER_S if members > 1 else 0.0
    return max(heartbeat_s / 2, stale_after_s / 2 - heartbeat_s, grown)


def patience(heartbeat_s: float, stale_after_s: float, members: int = 0) -> float:
    """Seconds of silence after which the other end is taken for gone: stale_after_s, and twice
    what the swarm's size added to the quiet limit (which so stays within half of it)."""
    base = quiet_limit(heartbeat_s, stale_after_s)
    return stale_after_s + 2 * (quiet_limit(heartbeat_s, stale_after_s, members) - base)


def overdue(waited: float, expected: float, factor: float, heartbeat_s: float, others: int) -> bool:
    """A node past its deadline: it waited more than `factor` times what its speed predicts, plus
    heartbeat slack. `others`: the members that could take its work over (anyone else in the
    swarm); the last one standing has no deadline (its silence ends it instead)."""
    return others > 0 and waited > factor * expected + 2 * heartbeat_s


QUORUM_GRACE_MIN_S = 0.5  # a message's lag on a slow link (a relayed path's round trip is ~0.3 s)


def quorum_grace(step_s: float) -> float:
    """How long the barrier waits for the rest once the quorum is in: one inner step of the
    swarm's median member (told to stop at its next step, a member merely behind arrives within
    one), and never less than a message's lag."""
    return max(QUORUM_GRACE_MIN_S, step_s)


def quorum_cut(share_synced: float, quorum: float, since_quorum_s: float, grace_s: float) -> bool:
    """The barrier goes on without the members still out: members holding `quorum` of the
    barrier's weight (their share of its speed) synced more than `grace_s` ago (quorum_grace).
    A node lost mid-round then costs the swarm that grace, not its deadline; one that is only
    late loses nothing: its work merges into its next round, scaled for staleness. Below the
    quorum nobody is cut early: most of the swarm silent is the coordinator's own network."""
    return share_synced >= quorum and since_quorum_s > grace_s


STALENESS_EXPONENT = 0.5  # FedAsync's polynomial staleness (Xie et al. 2019), as FedBuff uses it (Nguyen et al. 2022)


def staleness_scale(rounds_late: int) -> float:
    """The share of a late member's Δ that is merged `rounds_late` rounds after the θ it was
    computed against: (1 + τ)^-0.5, so one round late keeps ~71 %."""
    return (1 + rounds_late) ** -STALENESS_EXPONENT


def majority_done_s(done_after: Mapping[str, float], ring: list[str]) -> float | None:
    """How long after BarrierReady more than half of the ring had reported θ (`done_after`:
    member -> seconds after BarrierReady of its report); None while fewer have. The first
    reporter proves nothing about the others: a member that withholds its bytes receives everyone
    else's and can be the first to finish, while those it starves cannot."""
    members = set(ring)
    times = sorted(t for i, t in done_after.items() if i in members)
    need = len(ring) // 2 + 1
    return times[need - 1] if len(times) >= need else None


def reduce_overdue(
    ring: list[str],
    recs: Records,
    waited: float,
    majority_s: float | None,
    factor: float,
    slack: float,
    extra: Mapping[str, float] | None = None,
) -> list[str]:
    """Ring members that have not reported θ long after a majority did: `waited` seconds since
    BarrierReady, `majority_s` what the majority took for the same all-reduce and outer step
    (majority_done_s). The ring is all or nothing, so a majority that finished proves the
    others' part is done: past `factor` times its time plus `slack` (plus `extra[i]`: work only
    node i does, an evaluation) a member that is still silent is behind. Before a majority
    finished nobody is behind: silence is charged to whom the members name (caught), or, past
    the reduce deadline (reduce_timed_out), to nobody but a ring of one."""
    if majority_s is None:
        return []
    extra = extra or {}
    return [
        i
        for i in ring
        if recs[i].done is None and not recs[i].behind and waited > factor * majority_s + slack + extra.get(i, 0.0)
    ]


def failure_heard(
    ring: Collection[str],
    done: Set[str],
    failed: Set[str],
    caught: Set[str],
    evidence: bool,
    waited: float,
    grace: float,
    expired: bool,
) -> bool:
    """The all-reduce broke `waited` seconds ago (a member left, or `failed` reported it): whether
    to decide now (retry, or keep what a majority applied).

    At once when a member reported the failure and every ring member has reported (θ or failure)
    or is `caught` (named by two, or behind: silent long after a majority reported; its own word
    would change nothing); or past the reduce deadline (`expired`). After `grace` (the time a
    member still in the ring needs to report) when the failure is more than one member's word:
    `evidence` of the coordinator's own (a member left: it saw the connection close; one is proven
    to have forged bytes; a member's first lone report early in the round: Round.first_alone), a
    member caught, more than half the ring reporting it (an honest failure closes every member's
    ring connections, so all of them report within moments), or a ring of two (one report is as
    much as its silent partner can contradict). Otherwise a lone report waits for the others: a
    member that says the ring failed while it keeps sending cannot have a slow all-reduce redone.
    A member that only left decides nothing early: the others' RoundDones settle the round."""
    heard = done | failed | caught
    if expired or (failed and all(i in heard for i in ring)):
        return True
    return waited > grace and (evidence or bool(caught) or 2 * len(failed) > len(ring) or len(ring) <= 2)


REDUCE_DEADLINE_S = 150.0  # reduce_deadline for no bytes: the nodes' ring timeouts (120 s) and slack


def reduce_deadline(n_params: int, min_rate: float) -> float:
    """Seconds after BarrierReady past which an all-reduce no majority finished is redone: the
    nodes' ring timeouts and slack (REDUCE_DEADLINE_S), plus what the nodes' own pass deadlines
    allow for the bytes (drift/ring.py: three times them at `min_rate`), counted as fp32 both
    ways, the most any rule sends a member. A fixed 150 s redid every round of a model whose
    all-reduce takes longer: a billion values in int8 over a 20 Mbit/s uplink take ~800 s."""
    return REDUCE_DEADLINE_S + 3 * 8 * n_params / min_rate


def reduce_timed_out(
    ring: list[str], done: Iterable[str], waited: float, deadline: float = REDUCE_DEADLINE_S
) -> list[str]:
    """Past the reduce deadline with no majority of the ring reporting θ: the members to charge.
    A ring of one has nobody else to blame: its member (it is the whole round). In a ring of two
    whose other member reported, the silent one: an honest node reports within its ring timeout
    (RingFailed, naming whom it waited for), however the other behaved. In a larger ring silence
    is charged to whom two members name (caught), never to everyone still waiting: []."""
    reported = set(done) & set(ring)
    if waited <= deadline or 2 * len(reported) > len(ring):
        return []
    if len(ring) == 1 or (len(ring) == 2 and reported):
        return [i for i in ring if i not in reported]
    return []


def steps_of(units: list[P.WorkUnit], batch_size: int) -> int:
    """The inner steps a node's granted, trained samples take: what the coordinator knows,
    whatever BarrierSync.steps says."""
    return max(1, -(-samples(units) // max(batch_size, 1)))


def tail_stops(
    active: list[str], in_hand: Mapping[str, int], remaining: int, speed: Mapping[str, float], batch_size: int
) -> list[str]:
    """Nodes whose next inner step would end after everyone else ran out of work: they stop now,
    so nobody waits at the barrier for most of a slow step. Slowest first; one always goes on."""
    stops: list[str] = []
    # Running totals over the nodes still going (O(N log N): a round of a thousand nodes runs this every tick).
    work, rate, going = sum(in_hand[j] for j in active), sum(speed[j] for j in active), len(active)
    for i in sorted(active, key=lambda i: speed[i]):
        if going < 2:
            break
        left_s = (remaining + work - in_hand[i]) / (rate - speed[i])
        if batch_size / speed[i] > left_s:
            stops.append(i)
            work, rate, going = work - in_hand[i], rate - speed[i], going - 1
    return stops


NORM_OUTLIER = 10.0  # a Δ this many times the median size per inner step is no honest one


def norm_outliers(norms: Mapping[str, tuple[float, int]], factor: float = NORM_OUTLIER) -> list[str]:
    """Nodes whose reported Δ norm per inner step is more than `factor` times the median of all
    (norm, steps) reports: with three or more reports a single outlier cannot move the median.
    With fewer, nobody can tell which one is off: none is."""
    if len(norms) < 3:
        return []
    per_step = {i: n / max(steps, 1) for i, (n, steps) in norms.items()}
    median = sorted(per_step.values())[len(per_step) // 2]
    return [i for i, v in per_step.items() if median > 0 and v > factor * median]


def named_outliers(reports: Mapping[str, list[str]], ring: list[str]) -> list[str]:
    """Ring members named as outliers (by a sync rule that sees every contribution and clips each
    to a multiple of the median) by more than half of the other members. Every honest member
    computes the same names, so one node alone cannot frame another."""
    votes = Counter(j for i, named in reports.items() for j in set(named) if j != i)  # (one pass: N² at 1,000)
    return [j for j in ring if 2 * votes[j] > len(ring) - 1]


class NoMajority(Exception):
    """No checksum of θ is held by more than half of the ring."""


def minority(checksums: Mapping[str, str]) -> list[str]:
    """The nodes whose θ checksum disagrees with the majority's; NoMajority when no checksum has
    more than half."""
    counts = Counter(checksums.values())
    if len(counts) <= 1:
        return []
    top, n = counts.most_common(1)[0]
    if 2 * n <= len(checksums):
        raise NoMajority()
    return [i for i, c in checksums.items() if c != top]


@dataclass(frozen=True)
class Equivocation:
    equivocators: list[str]  # members proven to have signed two different payloads (ring order)
    false: list[str]  # members that reported a payload its owner did not sign (ring order)
    false_sums: list[str] = field(default_factory=list)  # members proven to have signed a false
    # block payload of the hierarchy (ring order)


def equivocation(
    heard: Mapping[str, Iterable[tuple[str, str, str, int]]],
    ring: list[str],
    signed: Callable[[str, str, str, int], bool],
    block: Callable[[str, int], Hashable] = lambda sender, level: sender,
) -> Equivocation:
    """What the members' reports of one all-gather attempt prove. `heard`: reporter -> (sender,
    sha256 of the payload it got from that sender, the sender's signature of it, the level of
    the hierarchy: 0 for the sender's own payload), per payload received; `signed(sender, digest,
    sig, level)`: whether that is the sender's signature of that digest for this round, attempt
    and level (drift.gather.signed_payload). A sender of which two different digests are
    reported for one level, each signed, sent different payloads where it owed everyone the same
    (its own, or its block's, which its block computes alike): only it can sign in its name, so
    no reporter can frame it. A report whose signature does not hold is made up by its reporter
    (honest code reports only payloads whose signature it checked). Reports on non-members or on
    the reporter itself are ignored; each distinct report is checked once.
    Above level 0 a sender sends its block's payload (`block(sender, level)`: which block), which
    every member of the block computes alike from what it received below (SparseLoCo.merge): a
    member that signed another digest than two or more of its block did, and more than signed
    any other, summed falsely, by their signatures and its own (drift/hierarchy.py counts on
    blocks of several members: liars that outnumber their block could frame one). Levels are
    judged bottom up, and a member that received a payload proven false, or of an equivocator,
    or of a block whose members disagree with no majority, computed its own block's payload
    from it honestly: it is misled, not judged, at the levels above."""
    members = set(ring)
    checked: dict[tuple[str, str, str, int], bool] = {}
    digests: dict[tuple[str, int], set[str]] = {}
    got: list[tuple[str, str, int, str]] = []  # (reporter, sender, level, digest): the signed reports
    false: set[str] = set()
    for i, reports in heard.items():
        for report in reports:
            sender, digest, _, level = report
            if sender == i or sender not in members:
                continue
            if report not in checked:
                checked[report] = signed(*report)
            if checked[report]:
                digests.setdefault((sender, level), set()).add(digest)
                got.append((i, sender, level, digest))
            else:
                false.add(i)
    twice = {j for (j, _), seen in digests.items() if len(seen) > 1}
    wrong: set[str] = set()  # proven to have summed falsely
    misled: set[str] = set()  # received a payload proven bad (or disputed) below
    for level in sorted({lv for _, lv in digests}):
        said: dict[Hashable, dict[str, str]] = {}  # block -> sender -> the digest it signed
        for (j, lv), seen in digests.items():
            if lv == level and j not in twice and j not in misled:
                said.setdefault(block(j, level), {})[j] = next(iter(seen))
        right: dict[Hashable, str] = {}  # block -> its payload's digest, where proven
        for b, claims in said.items():
            (top, n), *rest = Counter(claims.values()).most_common()
            if level > 0 and n >= 2 and all(m < n for _, m in rest):
                right[b] = top
                wrong |= {j for j, d in claims.items() if d != top}
        disputed = {b for b, claims in said.items() if b not in right and len(set(claims.values())) > 1}
        for i, j, lv, d in got:
            b = block(j, level) if lv == level else None
            if lv == level and (j in twice or j in wrong or b in disputed or right.get(b, d) != d):
                misled.add(i)
    return Equivocation(
        [j for j in ring if j in twice], [i for i in ring if i in false], [j for j in ring if j in wrong]
    )


def kept(checksums: Mapping[str, str], ring: list[str]) -> str:
    """The θ a round keeps when an equivocator split the other members (their checksums): the
    one most of them hold, on a tie the one of the first in ring order. Each is as good as
    another: every honest member's payload is in it, and one that the equivocator signed."""
    counts = Counter(checksums.values())
    top = max(counts.values())
    return next(checksums[i] for i in ring if i in checksums and counts[checksums[i]] == top)


@dataclass(frozen=True)
class PairVerdict:
    action: Literal["commit", "redo", "drop", "undecided"]
    culprits: Mapping[str, str] = field(default_factory=dict)  # node -> why it is the broken one


def pair_verdict(
    announced: Mapping[str, str], before: Mapping[str, str], earlier: Mapping[str, str], agreed: str
) -> PairVerdict:
    """A ring of two has no majority, so its members announce the θ their outer step would give
    (`announced`, node -> checksum) and nobody applies it yet. The same θ (or one announcer: the
    other is behind): commit. Different, the first time: redo the round (nothing moved; in the
    redo each member also reports the checksum of the state it steps from, `before`). Different
    again (`earlier`: the first attempt's announcements): a member whose state is no longer the
    `agreed` θ of the round before is the broken one, else one whose θ differs from what it
    announced the first time; if that is both or neither, nobody can tell which θ is right."""
    if len(set(announced.values())) <= 1:
        return PairVerdict("commit")
    if not earlier:
        return PairVerdict("redo")
    bad = {
        i: "the state its outer step starts from is no longer the agreed θ"
        for i in announced
        if before.get(i) != agreed
    }
    if not bad:
        bad = {i: "its outer step gives another θ each time" for i, c in announced.items() if earlier.get(i, c) != c}
    if 0 < len(bad) < len(announced):
        return PairVerdict("drop", bad)
    return PairVerdict("undecided")


def held_by_majority(checksums: Mapping[str, str], ring_size: int) -> str | None:
    """The θ checksum that more than half of a ring of `ring_size` members reported, or None."""
    top = Counter(checksums.values()).most_common(1)
    return top[0][0] if top and 2 * top[0][1] > ring_size else None


def finished_by_majority(ring: list[str], done: set[str]) -> bool:
    """A ring that a majority of its members finished (and whose finishers agree, checked by the
    caller) counts even though the others report it failed: the ring is all or nothing."""
    failed = [i for i in ring if i not in done]
    return bool(failed) and 2 * (len(ring) - len(failed)) > len(ring)


def accused(
    accusations: Iterable[tuple[int, str, str, int]], failed: Mapping[tuple[int, str], tuple[int, str]]
) -> dict[str, set[str]]:
    """Member -> the members whose accusation of it counts (RingFailed.suspect), from (attempt,
    suspect, accuser, level) over a round's attempts; `failed`: (attempt, member) -> (the level
    at which it reported failing, whom it named). In the sparse rule's hierarchy
    (drift/hierarchy.py) a member whose gather failed at a level sends nothing above it, so those
    that wait for it there name it. Such an accusation does not count when the accused failed
    lower in that attempt and is excused: it named a member caught (two counted accusers) or
    excused itself. Levels are taken bottom up, so the one that withheld is caught and those it
    held up are not; one that only claims to have been held up names somebody nobody else
    names, is not excused, and is caught by those it held up."""
    out: dict[str, set[str]] = {}
    for attempt in sorted({a for a, *_ in accusations}):
        here = [(s, by, lv) for a, s, by, lv in accusations if a == attempt]
        excused: set[str] = set()
        for level in sorted({lv for *_, lv in here}):
            for suspect, accuser, lv in here:
                low = failed.get((attempt, suspect), (level, ""))[0] < level
                if lv == level and not (suspect in excused and low):
                    out.setdefault(suspect, set()).add(accuser)
            caught = {s for s, by in out.items() if len(by) >= 2}
            excused |= {
                x for (a, x), (lv, y) in failed.items() if a == attempt and lv <= level and y in caught | excused
            }
    return out


def caught(suspects: Mapping[str, set[str]], ring: list[str]) -> list[str]:
    """Ring members caught breaking the all-reduce by both their neighbours (the ring reverses on
    every retry, so each node's output reaches two neighbours; one node alone cannot frame another)."""
    return [i for i, by in suspects.items() if len(by) >= 2 and i in ring]


def flat_from_now(
    grid: bool, named: Collection[str], left: Collection[str], failed: Collection[str], ring: int
) -> bool:
    """A failed all-reduce attempt moves the swarm to the flat ring for a while (`flat_rounds`): it
    ran as a grid (drift/ring.py), more than half its members reported it failed, and nobody was
    named for it (caught by two, or proven to forge) or left it. A grid's columns and its rows'
    all-gathers wait on whatever the pass before waits on, so their timeouts name nobody: a member
    silent there would stall every round and never be named. On the flat ring every wait names the
    one waited for, and a retry reverses the ring, so its other neighbour names it too (caught).
    A lone report of a failure (a member's word) is not enough: it only has the attempt redone."""
    return grid and not named and not left and 2 * len(failed) > ring


def flat_rounds(times: int) -> int:
    """Rounds the swarm stays on the flat ring after its `times`-th such failure (1, 2, ...): twice
    as long each time, so a member that is silent in the grid only stalls ever rarer rounds, and an
    honest failure costs the grid's speed for a while, not for the run."""
    return 2**times


def planning_speeds(speeds: Mapping[str, float], measured: Set[str]) -> dict[str, float]:
    """The speeds a round is planned with (units by speed, who evaluates): what our clock
    measured, or a node's own claim (its calibration) where nothing is measured yet, but never
    above the fastest measured node. Unbounded, a few slow measurements beside fast claims nobody
    checked made 59 of 64 lightweight nodes evaluators and gave 5 of them the whole round."""
    top = max((v for i, v in speeds.items() if i in measured), default=None)
    if top is None:
        return dict(speeds)
    return {i: v if i in measured else min(v, top) for i, v in speeds.items()}


def evaluators(speeds: Mapping[str, float], budget: int, batch_size: int, slow_fraction: float) -> set[str]:
    """Nodes so slow that one inner step would hold the swarm back: they evaluate instead.

    A node evaluates when it is more than 1/slow_fraction times slower than the reference node
    AND a single inner step of it takes longer than slow_fraction of the round's expected length
    (the round budget over the trainers' summed speed). The reference is the second fastest when
    there are three or more nodes, so one node that reports itself very fast cannot make every
    other node an evaluator (and be the only trainer); with two, nobody can tell which one is
    off, and the fastest is the reference. The reference and any faster node train."""
    if not speeds:
        return set()
    ranked = sorted(speeds, key=speeds.get, reverse=True)
    keep = ranked[:2] if len(ranked) >= 3 else ranked[:1]
    ref = keep[-1]
    out: set[str] = set()
    total = sum(speeds.values())  # (of the nodes not out: a sum per node was N² at 1,000)
    for i in reversed(ranked):  # slowest first
        if i in keep:
            break
        round_s = budget / total
        if speeds[i] < slow_fraction * speeds[ref] and batch_size / speeds[i] > slow_fraction * round_s:
            out.add(i)
            total -= speeds[i]
    return out


def bound_claim(claim: float, others: list[float]) -> float:
    """A speed nobody has measured yet, at most the lower median of all claims: one node that
    claims 10⁹ samples/s cannot take the first round's plan (or make every other node an
    evaluator). An honest fast node is planned lower for its first unit only, and takes more
    by stealing meanwhile. With one other claim nobody can tell which is the lie: it stands (a
    very slow honest node then evaluates from the first round on)."""
    return min(claim, claims_cap([*others, claim]))


def claims_cap(claims: list[float]) -> float:
    """The most any of these unmeasured claims may stand for (bound_claim): their lower median,
    or no bound with fewer than three. Capping every claim at once at this is the same as capping
    them one by one (a claim above the median capped to it leaves the median where it was), in
    O(N log N) for a swarm of N instead of N sorts."""
    if len(claims) < 3:
        return math.inf
    return sorted(claims)[(len(claims) - 1) // 2]
