"""A node's share of one round: train granted work units until the coordinator says stop.

The coordinator grants units as the node asks (ShardAssignment, then AssignNext), so every unit is
trained by exactly one node. This loop asks for the next units *before* it runs out — as soon as
the steps left in hand cover about one round trip to the coordinator — so a node never idles on
the network. StopRound cuts the round at the next inner step: the part of a unit already trained
counts (it is in θ_local), the rest is handed back and trained in a later round.

Evaluator nodes (too slow to train without holding everyone back) are not in the round at all:
node.py has them fetch the newest θ from a peer and report its validation loss, at their own pace.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import queue
import threading
import time
from collections import deque
from collections.abc import Awaitable, Callable, Iterator
from dataclasses import dataclass, field

import numpy as np

from drift import protocol as P
from drift.data import DataUnavailable
from drift.diloco import epoch_order, unit_indices

log = logging.getLogger("drift.node")

ASK_EARLY_S = 0.05  # an ask due this soon rides on a unit's report (one frame, not two)
REPORT_S = 0.025  # a unit shorter than this, ending this soon after the last report, waits for the next report


class StopTraining(Exception):
    """The coordinator cancelled the run (`lost` False) or went away (`lost` True)."""

    def __init__(self, reason: str, lost: bool = False) -> None:
        super().__init__(reason)
        self.lost = lost


@dataclass
class RoundReport:
    samples: int = 0
    steps: int = 0
    losses: list[float] = field(default_factory=list)
    trained: list[P.WorkUnit] = field(default_factory=list)
    returned: list[P.WorkUnit] = field(default_factory=list)
    val_loss: float | None = None  # report_val in round 0: the loss of the initial θ
    val_samples: int = 0
    metrics: dict[str, float] = field(default_factory=dict)  # the task's, beside val_loss
    busy_s: float = 0.0  # seconds spent in inner steps
    lr: float = 0.0  # the inner learning rate of the round
    # The reports of the units trained last, not sent: the round ended with them, and the barrier
    # report lists them (the coordinator counts them then: one frame a node, not two). The node
    # sends them when its BarrierSync would come late (drift.rules.reports_ride).
    unsent: list[P.TrainProgress] = field(default_factory=list)
    unreported_s: float = 0.0  # seconds from the last TrainProgress sent (or the round's start) to the round's end

    def barrier_sync(self, rnd: int) -> P.BarrierSync:
        return P.BarrierSync(
            round=rnd,
            samples=self.samples,
            steps=self.steps,
            loss=mean_loss(self.losses),
            busy_s=self.busy_s,
            lr=self.lr,
            trained=self.trained,
            returned=self.returned,
            val_loss=self.val_loss,
            val_samples=self.val_samples,
            metrics=self.metrics,
        )


@dataclass
class _Piece:
    """A granted unit on its way through the thread that trains."""

    unit: P.WorkUnit
    batches: list[np.ndarray]
    start: int  # where its (remaining) steps begin in the job that trains it
    losses: list[float] = field(default_factory=list)
    seconds: list[float] = field(default_factory=list)


class InnerLoop:
    """Runs rounds for one node; the worker does the math, this decides what to train when.
    `_apply` handles the coordinator's messages while a round trains, in one `match`."""

    def __init__(
        self,
        worker,
        recipe,
        inbox: asyncio.Queue,
        send: Callable[[P._Msg], Awaitable[None]],
        lock: asyncio.Lock | None = None,
        defer: Callable[[P.Message], None] = lambda msg: None,
    ):
        """`defer`: where messages that are not this loop's go (the round loop reads them next)."""
        self.worker = worker
        self.defer = defer
        # Held for every step: whoever else changes the worker's model between steps (the
        # overlapped sync's catch-up, an evaluation of θ_global) takes it too.
        self.lock = lock or ModelLock()
        self.recipe = recipe
        self.inbox = inbox
        self.send = send
        self._orders: dict[int, np.ndarray] = {}
        self._round = 0
        self.data = None  # drift.data.DataClient when the samples come from a data holder (node.py)
        self.step_s = 0.0  # EMA of one inner step (what the swarm sees)
        self.rtt_s = 0.05  # EMA of AskForMoreWork -> reply
        self.report_s = REPORT_S

    @property
    def round(self) -> int:
        """The round this loop trains (or last trained)."""
        return self._round

    async def _run(self, fn, *args):
        """Run one worker call off the event loop (so heartbeats and messages keep flowing), with
        the worker's lock."""
        async with self.lock:
            return await asyncio.get_running_loop().run_in_executor(None, fn, *args)

    async def evaluate(self, rnd: int | None = None) -> tuple[float | None, float]:
        """(val loss of the worker's θ, or None when the loop has no evaluation; seconds per
        evaluation batch it took)."""
        r = self.recipe
        n = min(self.worker.n_val, r.eval_batches * r.batch_size)
        batches = max(1, -(-n // r.batch_size))
        await self._have("val", np.arange(n))
        t0 = time.perf_counter()
        val = await self._run(self.worker.evaluate, r.eval_batches, r.batch_size)
        return val, (time.perf_counter() - t0) / batches

    def metrics(self) -> dict[str, float]:
        """The task's metrics of the last evaluate() ({} when the task defines none)."""
        return dict(getattr(self.worker, "metrics", {}))

    def _order(self, epoch: int) -> np.ndarray:
        """The epoch's sample order (kept for the last two epochs: a round may span both)."""
        if epoch not in self._orders:
            self._orders = {e: o for e, o in self._orders.items() if e >= epoch - 1}
            self._orders[epoch] = epoch_order(self.worker.n_train, self.recipe.seed, epoch)
        return self._orders[epoch]

    def _poll(self, state: dict) -> None:
        """Apply control messages that arrived while we were computing."""
        while True:
            try:
                msg = self.inbox.get_nowait()
            except asyncio.QueueEmpty:
                return
            self._apply(msg, state)

    def _apply(self, msg: P.Message | None, state: dict) -> None:
        """One control message that came while a round trains (None: the connection ended)."""
        match msg:
            case None:
                raise StopTraining("lost the connection to the coordinator", lost=True)
            case P.TrainingCancel():
                raise StopTraining(f"training cancelled by coordinator: {msg.reason}")
            case P.AssignNext() | P.NoMoreWork() | P.MoreWork() | P.StopRound() if msg.round != state["round"]:
                pass  # a late reply to the previous round
            case P.AssignNext():
                state["granted"].extend(msg.units)
                self._prefetch(msg.units)
                state["asked"], state["no_more"] = False, msg.no_more
                self.rtt_s = 0.8 * self.rtt_s + 0.2 * (time.perf_counter() - state["asked_at"])
            case P.NoMoreWork():
                state["no_more"] = True
                state["asked"] = False
            case P.MoreWork():
                state["no_more"] = False  # (the next ask point asks)
            case P.StopRound():
                state["stop"] = True
            case P.ShardAssignment() | P.TrainComplete():
                self.defer(msg)  # for the round loop, in order
                state["stop"] = True  # the swarm went on without us (we missed a deadline, or it ended)
            case _:
                self.defer(msg)  # for the round loop, in order

    async def run_round(self, a: P.ShardAssignment) -> RoundReport:
        self._round = a.round
        # The swarm's progress, not this node's: every node of a round trains at the same rate.
        lr = self.recipe.round_lr(a.progress)
        self.worker.set_lr(lr)
        report = RoundReport(lr=lr)
        if a.report_val and a.round == 0:  # the loss before any training, for the record
            report.val_loss, _ = await self.evaluate()
            report.metrics = self.metrics()
            report.val_samples = min(self.worker.n_val, self.recipe.eval_batches * self.recipe.batch_size)
        state = {
            "round": a.round,
            "granted": deque(a.units),
            "asked": False,
            "asked_at": 0.0,
            "no_more": a.no_more,  # (nothing is left to grant after these units: no ask this round)
            "stop": False,
            "unsent": [],  # TrainProgress of units that may have been the round's last (RoundReport.unsent)
            "reported_at": time.perf_counter(),  # when the last TrainProgress went (or the round started)
        }
        self._prefetch(state["granted"])
        pieces: deque[_Piece] = deque()  # units being trained, in order
        while True:
            self._poll(state)
            if state["stop"] or (not state["granted"] and not pieces and state["no_more"]):
                break
            if not state["granted"] and not pieces:
                if not state["asked"]:
                    await self._ask(state)
                self._apply(await self.inbox.get(), state)
                continue
            await self._train(state, pieces, report)
        for p in pieces:  # (StopRound: what of them is trained counts, the rest goes back)
            await self._report(p, report, state, last=True)
        # A grant may still be on its way: wait for it, then hand back every untrained unit once.
        while state["asked"]:
            self._apply(await self.inbox.get(), state)
        report.returned += list(state["granted"])
        report.unsent, report.unreported_s = state["unsent"], time.perf_counter() - state["reported_at"]
        return report

    async def _train(self, state: dict, pieces: deque[_Piece], report: RoundReport) -> None:
        """Train the units in hand on the thread that trains, as one job that grows as units are
        granted (so it never waits for this loop between two steps, nor between two units),
        holding the worker's lock, until they run out, StopRound, or someone else asks for the
        lock (they get it at the next step; the rest of the unit in hand trains after them).
        Meanwhile: apply control messages, ask for more work ahead, report each unit trained."""
        loop = asyncio.get_running_loop()
        job = UnitSteps([], self.recipe.micro_batches)
        finished, poke = self._notices(job, loop)
        async with self.lock:
            self.lock.pause_with(job.pause)
            taken = 0  # job's steps handed to pieces so far
            poked = got = None
            started = False
            try:
                for p in pieces:  # (the rest of units a pause interrupted)
                    p.start = len(job.batches)
                    job.extend(p.batches[len(p.losses) :])
                await self._feed(job, pieces, state, report)
                if not job.batches:
                    return
                self._start(job, loop)
                started = True
                await self._ask_ahead(job, pieces, state)
                poked, got = asyncio.ensure_future(poke.wait()), asyncio.ensure_future(self.inbox.get())
                while True:  # what came first: a message, a unit trained or the ask point, the end
                    if got.done():
                        msg, got = got.result(), asyncio.ensure_future(self.inbox.get())
                        self._apply(msg, state)
                        job.stop = job.stop or state["stop"]
                        await self._feed(job, pieces, state, report)
                        await self._ask_ahead(job, pieces, state)
                    elif poked.done():
                        poke.clear()
                        poked = asyncio.ensure_future(poke.wait())
                        taken = await self._collect(job, taken, pieces, report, state)
                        await self._ask_ahead(job, pieces, state)
                    elif finished.done():
                        taken = await self._collect(job, taken, pieces, report, state)
                        if not got.done():  # (else that message first)
                            break
                    else:
                        await asyncio.wait((finished, poked, got), return_when=asyncio.FIRST_COMPLETED)
            finally:
                self.lock.pause_with(None)
                for f in (poked, got):
                    if f is not None:
                        f.cancel()
                if started and not finished.done():  # leaving early (the connection is gone): stop at the next step
                    job.stop = True
                    await finished
        if job.error is not None:
            raise job.error

    def _notices(self, job: UnitSteps, loop: asyncio.AbstractEventLoop) -> tuple[asyncio.Future, asyncio.Event]:
        """(done when the job is, set when it says "ask" or "unit"): the thread that trains tells
        this loop without ever waiting for it."""
        finished: asyncio.Future[None] = loop.create_future()
        poke = asyncio.Event()

        def notice(kind: str) -> None:  # on the node's loop
            if kind != "done":
                poke.set()
            elif not finished.done():
                finished.set_result(None)

        def threadsafe(kind: str) -> None:  # on the thread that trains
            with contextlib.suppress(RuntimeError):  # the node's loop is closed: nobody waits any more
                loop.call_soon_threadsafe(notice, kind)

        job.notify = threadsafe
        return finished, poke

    def _start(self, job: UnitSteps, loop: asyncio.AbstractEventLoop) -> None:
        if isinstance(self.worker, OnLoop):
            self.worker.run_unit(job)
        else:  # a worker of its own (tests, tools): a thread of the executor steps it
            loop.run_in_executor(None, job.run, self.worker.train_step)

    async def _steps(self, job: UnitSteps) -> None:
        """Run `job` on the thread that trains, holding the worker's lock, until it is done."""
        loop = asyncio.get_running_loop()
        finished, _ = self._notices(job, loop)
        async with self.lock:
            self._start(job, loop)
            await finished

    async def _feed(self, job: UnitSteps, pieces: deque[_Piece], state: dict, report: RoundReport) -> None:
        """The granted units onto the job (while it still takes steps), checked, their samples there."""
        bs = self.recipe.batch_size
        while state["granted"] and not state["stop"] and not job.stop:
            unit = state["granted"][0]
            size = min(self.recipe.unit_samples, self.worker.n_train - unit.id * self.recipe.unit_samples)
            if not unit.hi <= size:  # a coordinator that names samples the dataset does not have
                raise StopTraining(
                    f"the coordinator granted samples {unit.lo}..{unit.hi} of unit {unit.id}, "
                    f"which the dataset ({self.worker.n_train} samples) does not have"
                )
            idx = self._indices(unit)
            if self.data is not None and not await self.data.ready("train", idx, lambda: self._stopped(state)):
                state["granted"].popleft()
                report.returned.append(unit)  # no holder could serve it: back to the queue
                continue
            p = _Piece(unit, [idx[o : o + bs] for o in range(0, unit.hi - unit.lo, bs)], len(job.batches))
            if not job.extend(p.batches):
                return  # it ended meanwhile: the next job takes the unit
            state["granted"].popleft()
            pieces.append(p)
        job.stop = job.stop or state["stop"]

    async def _collect(self, job: UnitSteps, taken: int, pieces: deque[_Piece], report, state) -> int:
        """Hand the job's steps done so far to their units; report each unit trained whole (the
        last one also asks for the next unit, when that is due before the next one ends)."""
        upto = len(job.losses)
        while taken < upto:
            p = pieces[0]
            dt = job.seconds[taken]
            p.losses.append(job.losses[taken])
            p.seconds.append(dt)
            report.busy_s += dt
            self.step_s = dt if self.step_s == 0 else 0.7 * self.step_s + 0.3 * dt
            taken += 1
            if len(p.losses) == len(p.batches):
                pieces.popleft()
                ask = taken == upto and self._ask_soon(job, pieces, state)
                last = not pieces and not state["granted"] and state["no_more"]
                await self._report(p, report, state, ask=ask, last=last)
        return taken

    async def _report(self, p: _Piece, report: RoundReport, state: dict, ask: bool = False, last: bool = False) -> None:
        """Account for a unit: the part trained (TrainProgress, with the ask for the next unit
        riding on it if `ask`: one frame instead of two), and the rest handed back. The report of
        a `last` unit (nothing more in hand or to come) waits: the barrier report lists it."""
        unit, k = p.unit, len(p.losses)
        lo = min(unit.hi, unit.lo + k * self.recipe.batch_size)
        if k:
            done = unit.model_copy(update={"hi": lo})
            report.trained.append(done)
            report.samples += lo - unit.lo
            report.steps += k
            report.losses += p.losses
            msg = P.TrainProgress(
                round=state["round"],
                units=[done],
                steps=k,
                loss=mean_loss(p.losses),
                samples_per_s=(lo - unit.lo) / max(sum(p.seconds), 1e-9),
            )
            state["unsent"].append(msg)
            if ask:
                await self._ask(state)
            elif not last and not self._report_later(p, state):
                await self._send_unsent(state)
        if lo < unit.hi:
            report.returned.append(unit.model_copy(update={"lo": lo}))

    def _report_later(self, p: _Piece, state: dict) -> bool:
        """A unit's report may wait for the next one (one frame for several): it took less than
        report_s and ended less than report_s after the last report, so another comes soon. Not
        while an ask is out: the coordinator may hold that ask until it sees our progress."""
        soon = time.perf_counter() - state["reported_at"] < self.report_s
        return not state["asked"] and soon and sum(p.seconds) < self.report_s

    async def _ask_ahead(self, job: UnitSteps, pieces: deque[_Piece], state: dict) -> None:
        """Ask for the next unit when the steps still in hand cover about one round trip to the
        coordinator; or tell the thread that trains at which of the job's steps that will be."""
        job.ask_at = None
        at = self._ask_point(job, pieces, state)
        if at is None:
            return
        if at <= len(job.losses):
            await self._ask(state)
        elif at < len(job.batches):
            job.ask_at = at

    def _ask_point(self, job: UnitSteps, pieces: deque[_Piece], state: dict) -> int | None:
        """The job's step at which to ask for the next unit (None: no ask is due this round). Served
        data: as soon as the last unit in hand starts, so that the next one's samples are fetched
        while this one trains."""
        if state["asked"] or state["no_more"] or state["stop"] or job.stop:
            return None
        bs, done, n = self.recipe.batch_size, len(job.losses), len(job.batches)
        if self.data is not None and not state["granted"]:
            return max(done, pieces[-1].start if pieces else done)
        step_s = self._step_s(job)
        if step_s == 0:  # no step timed yet: one unit ahead of the one training, no more
            return done if len(pieces) <= 1 and not state["granted"] else None
        rest = sum(-(-(u.hi - u.lo) // bs) for u in state["granted"])
        return max(done, math.ceil(n + rest - max(self.rtt_s * 2, step_s) / step_s))

    def _step_s(self, job: UnitSteps) -> float:
        """An inner step's time: the running average, or in the first unit its last step (0: none yet)."""
        return self.step_s or (job.seconds[-1] if job.seconds else 0.0)

    def _ask_soon(self, job: UnitSteps, pieces: deque[_Piece], state: dict) -> bool:
        """An ask is due within the next ASK_EARLY_S of steps (and before the unit in hand ends): it
        may ride on the report of the unit that just did. A slow device asks at its time."""
        at = self._ask_point(job, pieces, state)
        step_s = self._step_s(job)
        if at is None or step_s <= 0:
            return False
        rest = len(pieces[0].batches) - len(pieces[0].losses) if pieces else 0
        return at <= len(job.losses) + min(rest, int(ASK_EARLY_S / step_s))

    def _indices(self, unit: P.WorkUnit) -> np.ndarray:
        return unit_indices(self._order(unit.epoch), unit, self.recipe.unit_samples)

    def _prefetch(self, units) -> None:
        """Served data: start fetching these units' samples now, ahead of their steps."""
        if self.data is not None:
            for unit in units:
                self.data.prefetch("train", self._indices(unit))

    async def _have(self, split: str, idx: np.ndarray) -> None:
        """Served data: these samples fetched before the worker reads them (so a read never waits
        on the network while it holds the worker). If no holder can serve them now, the worker's
        own read waits for one."""
        if self.data is not None and idx.size:
            with contextlib.suppress(DataUnavailable):
                await self.data.prefetch(split, idx)

    def _stopped(self, state: dict) -> bool:
        self._poll(state)
        return state["stop"]

    async def _ask(self, state: dict) -> None:
        """Ask for the next units: on the reports kept back (one frame), or on its own
        (AskForMoreWork) when there are none."""
        state["asked"], state["asked_at"] = True, time.perf_counter()
        if state["unsent"]:
            await self._send_unsent(state, ask=True)
        else:
            await self.send(P.AskForMoreWork(round=state["round"]))

    async def _send_unsent(self, state: dict, ask: bool = False) -> None:
        """The reports kept (for the next report, or for the barrier) go now, as one."""
        if state["unsent"]:
            msg = merged(state["unsent"]).model_copy(update={"ask": ask})
            state["unsent"] = []
            await self._send_report(state, msg)

    async def _send_report(self, state: dict, msg: P.TrainProgress) -> None:
        state["reported_at"] = time.perf_counter()
        await self.send(msg)


def merged(reports: list[P.TrainProgress]) -> P.TrainProgress:
    """Reports of one round as one, in order: their steps' mean loss (None if any was not
    finite), their samples over their seconds."""
    steps = sum(r.steps for r in reports)
    losses = [r.loss for r in reports]
    n = sum(u.hi - u.lo for r in reports for u in r.units)
    seconds = sum(sum(u.hi - u.lo for u in r.units) / r.samples_per_s for r in reports if r.samples_per_s > 0)
    return P.TrainProgress(
        round=reports[0].round,
        units=[u for r in reports for u in r.units],
        steps=steps,
        loss=None if None in losses else sum(r.loss * r.steps for r in reports) / max(steps, 1),
        samples_per_s=n / seconds if seconds > 0 else 0.0,
    )


def mean_loss(losses: list[float]) -> float | None:
    """The mean, or None when there is none or it is not finite (the wire carries finite numbers
    only; a node whose loss went NaN says so with its Δ at the barrier)."""
    m = float(np.mean(losses)) if losses else None
    return m if m is not None and math.isfinite(m) else None


def finite_positive(x: float | None) -> bool:
    return x is not None and math.isfinite(x) and x > 0


@dataclass(frozen=True)
class Calibration:
    samples_per_s: float  # what the swarm plans with
    eval_ratio: float  # one training step over one evaluation batch, in seconds


async def calibrate(inner: InnerLoop, steps: int = 3) -> Calibration:
    """Speed on the real task: one warm-up step, then the fastest of `steps` timed ones (robust
    to a busy moment), and one timed evaluation batch. The caller restores θ afterwards."""
    worker, bs = inner.worker, inner.recipe.batch_size
    idx = np.arange(min(bs, worker.n_train))
    await inner._have("train", idx)
    await inner._have("val", np.arange(min(bs, worker.n_val)))
    job = UnitSteps([idx] * (1 + steps), inner.recipe.micro_batches)
    await inner._steps(job)
    if job.error is not None:
        raise job.error
    step_s = min(job.seconds[1:])
    t0 = time.perf_counter()
    await inner._run(worker.evaluate, 1, bs)
    eval_s = time.perf_counter() - t0
    return Calibration(len(idx) / step_s, step_s / max(eval_s, 1e-9))


# --- the loop that trains: the node asks, the loop thread steps ------------------------------------


class SwarmClosed(Exception):
    """The training loop left the swarm (it ended, broke out of its loop, or raised)."""


class ModelLock(asyncio.Lock):
    """The worker's model, held for inner steps and by whoever else changes it between two (the
    overlapped sync's catch-up, an evaluation of θ_global). While a unit trains, `pause_with` says
    how to pause it at its next step: whoever waits for the lock waits one step, not a unit; also
    one who started waiting before the unit took the lock (behind it, or behind someone else)."""

    def __init__(self) -> None:
        super().__init__()
        self._pause: Callable[[], None] | None = None
        self._waiting = 0  # acquire() calls not yet returned

    async def acquire(self) -> bool:
        self._waiting += 1
        try:
            if self._pause is not None:
                self._pause()
            return await super().acquire()
        finally:
            self._waiting -= 1

    def pause_with(self, pause: Callable[[], None] | None) -> None:
        """The holder trains a unit, paused by `pause()` (None: it no longer does). If someone
        waits already, it pauses at once."""
        self._pause = pause
        if pause is not None and self._waiting:
            pause()


class UnitSteps:
    """Inner steps handed to the thread that trains in one piece (the batches of the units in
    hand; the node may add more while it runs): it runs them back to back, and between two steps
    only reads two flags the node may set meanwhile: stop (StopRound, or someone waits for the
    model) and ask_at (say "ask" before that step, so that the node asks the coordinator for more
    work ahead). It says "unit" when it finished one the node added, and "done" when it ends."""

    def __init__(self, batches: list[np.ndarray], micro_batches: int = 1) -> None:
        self.batches, self.micro_batches = list(batches), micro_batches
        self.stop = False
        self.ask_at: int | None = None
        self.losses: list[float] = []  # one a step done
        self.seconds: list[float] = []  # each step's, timed on the thread that trains
        self.error: BaseException | None = None
        self.notify: Callable[[str], None] = lambda kind: None  # ("ask", "unit", "done"), from the thread that trains
        self._ends: set[int] = set()  # step counts at which a unit the node added ends
        self._lock = threading.Lock()
        self._over = False  # it takes no more steps
        self._ended = False  # it said so

    def extend(self, batches: list[np.ndarray]) -> bool:
        """More steps at the end (one unit's); False if the job is over already."""
        with self._lock:
            if self._over:
                return False
            self.batches.extend(batches)
            self._ends.add(len(self.batches))
            return True

    def pause(self) -> None:
        """Stop at the next step (the node goes on with the rest later)."""
        self.stop = True

    def next(self) -> np.ndarray | None:
        """On the thread that trains: the next step's indices, or None when this job is over."""
        j = len(self.losses)
        with self._lock:
            if self.stop or j >= len(self.batches):
                self._over = True
                return None
        if self.ask_at is not None and j >= self.ask_at:
            self.ask_at = None
            self.notify("ask")
        return self.batches[j]

    def parts(self, indices: np.ndarray) -> int:
        """Micro-batches of the step on these indices."""
        return max(1, min(self.micro_batches, len(indices)))

    def stepped(self, loss: float, seconds: float) -> None:
        self.seconds.append(seconds)
        self.losses.append(float(loss))
        if len(self.losses) in self._ends:
            self.notify("unit")

    def end(self, error: BaseException | None = None) -> None:
        """This job is over (once: later calls do nothing)."""
        with self._lock:
            if self._ended:
                return
            self._ended = self._over = True
            self.error = error
        self.notify("done")

    def run(self, train_step: Callable[[np.ndarray, int], float]) -> None:
        """Run every step here with `train_step(indices, parts)` (a worker of its own)."""
        try:
            while (indices := self.next()) is not None:
                t0 = time.perf_counter()
                loss = train_step(indices, self.parts(indices))
                self.stepped(loss, time.perf_counter() - t0)
        except BaseException as e:  # handed to the node
            self.end(e)
        self.end()


class _Job:
    __slots__ = ("args", "done", "error", "fn", "result")

    def __init__(self, fn, args) -> None:
        self.fn, self.args = fn, args
        self.done = threading.Event()
        self.result, self.error = None, None

    def run(self) -> None:
        try:
            self.result = self.fn(*self.args)
        except BaseException as e:  # handed to the thread that asked
            self.error = e
        self.done.set()

    def fail(self) -> None:
        self.error = SwarmClosed("the training loop has ended")
        self.done.set()


class Steps:
    """The channel between a node (its asyncio loop, in a thread of its own) and the thread that
    runs the training loop (the user's script, or `drift join`'s loop over a task's worker).

    The node hands the loop thread a unit's steps at a time (UnitSteps): `serve()` yields the
    indices of each step, and each is done when the loop asks for the next batch (`stepped()`,
    the optimizer's step hook, records its loss). Nothing crosses between the threads per step;
    the node learns that the unit ended, or that it is time to ask for more work, from the job.
    Everything else the node does to the model (state in and out, evaluation, the outer step's
    write-back) is a call the loop thread runs between two steps."""

    def __init__(self) -> None:
        self._q: queue.Queue[_Job | UnitSteps | None] = queue.Queue()
        self._later: deque[UnitSteps] = deque()  # units handed over while one was training
        self._unit: UnitSteps | None = None  # the unit in hand
        self._loss: float | None = None  # the loss of the step in hand, once stepped() said it
        self._ended = threading.Event()  # the node is done: serve() returns
        self._closed = threading.Event()  # the loop is done: every call raises SwarmClosed
        self.thread: threading.Thread | None = None  # the loop thread, once it serves
        self.parts = 1  # micro-batches of the step in hand

    def call(self, fn, *args):
        """fn(*args) on the loop thread (directly when already on it); its result or its error."""
        if threading.current_thread() is self.thread:
            return fn(*args)
        job = _Job(fn, args)
        if self._closed.is_set():
            raise SwarmClosed("the training loop has ended")
        self._q.put(job)
        while not job.done.wait(0.2):
            if self._closed.is_set():
                raise SwarmClosed("the training loop has ended")
        if job.error is not None:
            raise job.error
        return job.result

    def submit(self, job: UnitSteps) -> None:
        """Hand the loop thread these steps; `job` says "done" when they are over."""
        self._q.put(job)
        if self._closed.is_set():
            self._fail_queued()

    def serve(self) -> Iterator[np.ndarray]:
        """On the loop thread: run the node's calls, and yield the indices of each inner step."""
        self.thread = threading.current_thread()
        try:
            while not self._ended.is_set() or not self._q.empty() or self._later:
                if self._later:
                    job = self._later.popleft()
                else:
                    try:
                        job = self._q.get(timeout=0.2)
                    except queue.Empty:
                        continue
                if isinstance(job, UnitSteps):
                    yield from self._steps(job)
                elif job is not None:
                    job.run()
        finally:
            self.close()

    def _steps(self, job: UnitSteps) -> Iterator[np.ndarray]:
        self._unit = job
        try:
            while True:
                self._calls()
                indices = job.next()
                if indices is None:
                    break
                self.parts, self._loss = job.parts(indices), None
                t0 = time.perf_counter()
                yield indices
                job.stepped(math.nan if self._loss is None else self._loss, time.perf_counter() - t0)
        except BaseException:  # the loop broke out of its loop, or raised
            job.end(SwarmClosed("the training loop has ended"))
            raise
        finally:
            self._unit = None
        job.end()

    def _calls(self) -> None:
        """The node's calls that came while a unit trains (between two of its steps)."""
        while not self._q.empty():
            try:
                job = self._q.get_nowait()
            except queue.Empty:
                return
            if isinstance(job, UnitSteps):
                self._later.append(job)
            elif job is not None:
                job.run()

    def stepped(self, loss: float = math.nan) -> None:
        """The inner step in hand is done (the optimizer's step hook, or the loop): its loss."""
        if self._loss is None:
            self._loss = float(loss)

    def end(self) -> None:
        """The node is done: serve() returns once the jobs in hand are run."""
        self._ended.set()
        self._q.put(None)

    def close(self) -> None:
        """The loop is done: jobs still asked for fail with SwarmClosed."""
        self._closed.set()
        self._ended.set()
        if (unit := self._unit) is not None:
            unit.end(SwarmClosed("the training loop has ended"))
        self._fail_queued()

    def _fail_queued(self) -> None:
        while self._later:
            self._later.popleft().end(SwarmClosed("the training loop has ended"))
        while True:
            try:
                job = self._q.get_nowait()
            except queue.Empty:
                return
            if isinstance(job, UnitSteps):
                job.end(SwarmClosed("the training loop has ended"))
            elif job is not None:
                job.fail()


class OnLoop:
    """A worker whose every call runs on the loop thread (see Steps); attributes read directly.
    Its inner steps are the loop's own (run_unit)."""

    def __init__(self, worker, steps: Steps) -> None:
        self._worker, self._steps = worker, steps

    def run_unit(self, job: UnitSteps) -> None:
        """Hand these steps to the loop thread (job says "done" when they are over)."""
        self._steps.submit(job)

    def __getattr__(self, name: str):
        value = getattr(self._worker, name)
        if not callable(value):
            return value
        if name == "iter_state":
            return self._iter_state
        return lambda *args: self._steps.call(value, *args)

    def _iter_state(self) -> Iterator[tuple[str, np.ndarray]]:
        it = self._steps.call(self._worker.iter_state)
        while True:
            item = self._steps.call(next, it, None)
            if item is None:
                return
            yield item
