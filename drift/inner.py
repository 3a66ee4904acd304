"""A node's share of one round: train granted work units until the coordinator says stop.

The coordinator grants units one at a time (ShardAssignment, then AssignNext), so every unit is
trained by exactly one node. This loop asks for the next unit *before* it runs out — as soon as
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


class InnerLoop:
    """Runs rounds for one node; the worker does the math, this decides what to train when."""

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
        self.lock = lock or asyncio.Lock()
        self.recipe = recipe
        self.inbox = inbox
        self.send = send
        self._orders: dict[int, np.ndarray] = {}
        self._round = 0
        self.data = None  # drift.data.DataClient when the samples come from a data holder (node.py)
        self.step_s = 0.0  # EMA of one inner step (what the swarm sees)
        self.rtt_s = 0.05  # EMA of AskForMoreWork -> reply

    @property
    def round(self) -> int:
        """The round this loop trains (or last trained)."""
        return self._round

    async def _run(self, fn, *args):
        """Run one worker call off the event loop (so heartbeats and messages keep flowing), with
        the worker's lock."""
        async with self.lock:
            return await asyncio.get_running_loop().run_in_executor(None, fn, *args)

    async def train_step(self, indices: np.ndarray) -> float:
        parts = min(self.recipe.micro_batches, len(indices))
        return await self._run(self.worker.train_step, indices, parts)

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
        if msg is None:
            raise StopTraining("lost the connection to the coordinator", lost=True)
        if isinstance(msg, P.TrainingCancel):
            raise StopTraining(f"training cancelled by coordinator: {msg.reason}")
        if not isinstance(msg, (P.AssignNext, P.NoMoreWork, P.StopRound)):
            self.defer(msg)  # for the round loop, in order
            if isinstance(msg, (P.ShardAssignment, P.TrainComplete)):
                state["stop"] = True  # the swarm went on without us (we missed a deadline, or it ended)
            return
        if msg.round != state["round"]:
            return  # a late reply to the previous round
        if isinstance(msg, P.AssignNext):
            state["granted"].append(msg.unit)
            self._prefetch([msg.unit])
            state["asked"] = False
            self.rtt_s = 0.8 * self.rtt_s + 0.2 * (time.perf_counter() - state["asked_at"])
        elif isinstance(msg, P.NoMoreWork):
            state["no_more"] = True
            state["asked"] = False
        elif isinstance(msg, P.StopRound):
            state["stop"] = True

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
            "no_more": False,
            "stop": False,
        }
        bs = self.recipe.batch_size
        self._prefetch(state["granted"])
        while True:
            self._poll(state)
            if state["stop"] or (not state["granted"] and state["no_more"]):
                break
            if not state["granted"]:
                if not state["asked"]:
                    await self._ask(state)
                self._apply(await self.inbox.get(), state)
                continue
            unit = state["granted"].popleft()
            size = min(self.recipe.unit_samples, self.worker.n_train - unit.id * self.recipe.unit_samples)
            if not unit.hi <= size:  # a coordinator that names samples the dataset does not have
                raise StopTraining(
                    f"the coordinator granted samples {unit.lo}..{unit.hi} of unit {unit.id}, "
                    f"which the dataset ({self.worker.n_train} samples) does not have"
                )
            idx = self._indices(unit)
            if self.data is not None and not await self.data.ready("train", idx, lambda: self._stopped(state)):
                report.returned.append(unit)  # no holder could serve it: back to the queue
                continue
            t0, lo, u_losses = time.perf_counter(), unit.lo, []
            while lo < unit.hi:
                # Ask ahead: the steps still in hand should cover a round trip to the coordinator.
                left = (unit.hi - lo) // bs + sum((u.hi - u.lo) // bs for u in state["granted"])
                # Served data: ask as soon as the last unit in hand starts, so the next one's
                # samples are fetched while this one trains.
                ahead = self.data is not None and not state["granted"]
                if (
                    not state["asked"]
                    and not state["no_more"]
                    and (ahead or left * self.step_s <= max(self.rtt_s * 2, self.step_s))
                ):
                    await self._ask(state)
                t_step = time.perf_counter()
                hi = min(lo + bs, unit.hi)
                u_losses.append(await self.train_step(idx[lo - unit.lo : hi - unit.lo]))
                dt = time.perf_counter() - t_step
                report.busy_s += dt
                self.step_s = dt if self.step_s == 0 else 0.7 * self.step_s + 0.3 * dt
                lo = hi
                self._poll(state)
                if state["stop"]:
                    break
            if lo > unit.lo:
                done = unit.model_copy(update={"hi": lo})
                report.trained.append(done)
                report.samples += lo - unit.lo
                report.steps += len(u_losses)
                report.losses += u_losses
                await self.send(
                    P.TrainProgress(
                        round=a.round,
                        unit=done,
                        steps=len(u_losses),
                        loss=mean_loss(u_losses),
                        samples_per_s=(lo - unit.lo) / (time.perf_counter() - t0),
                    )
                )
            if lo < unit.hi:
                report.returned.append(unit.model_copy(update={"lo": lo}))
        # A grant may still be on its way: wait for it, then hand back every untrained unit once.
        while state["asked"]:
            self._apply(await self.inbox.get(), state)
        report.returned += list(state["granted"])
        return report

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
        state["asked"], state["asked_at"] = True, time.perf_counter()
        await self.send(P.AskForMoreWork(round=state["round"]))


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
    await inner.train_step(idx)
    times = []
    for _ in range(steps):
        t0 = time.perf_counter()
        await inner.train_step(idx)
        times.append(time.perf_counter() - t0)
    step_s = min(times)
    t0 = time.perf_counter()
    await inner._run(worker.evaluate, 1, bs)
    eval_s = time.perf_counter() - t0
    return Calibration(len(idx) / step_s, step_s / max(eval_s, 1e-9))


# --- the loop that trains: the node asks, the loop thread steps ------------------------------------


class SwarmClosed(Exception):
    """The training loop left the swarm (it ended, broke out of its loop, or raised)."""


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


STEP = object()  # a job that is one inner step of the user's loop


class Steps:
    """The channel between a node (its asyncio loop, in a thread of its own) and the thread that
    runs the training loop (the user's script, or `drift join`'s loop over a task's worker).

    Everything the node does to the model happens on the loop thread, between two inner steps:
    each worker call (state in and out, evaluation, the outer step's write-back) is a job the
    loop thread runs while it waits in `serve()` for its next batch; an inner step is the job
    `serve()` answers by yielding the batch's indices, done when `stepped()` is called (the
    optimizer's step hook, or the loop itself)."""

    def __init__(self) -> None:
        self._q: queue.Queue[_Job | None] = queue.Queue()
        self._step: _Job | None = None
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

    def step(self, indices: np.ndarray, parts: int = 1) -> float:
        """One inner step of the loop on these samples (blocks until it is done); its loss or nan."""
        return self.call(STEP, indices, parts)

    def serve(self) -> Iterator[np.ndarray]:
        """On the loop thread: run the node's jobs, and yield the indices of each inner step."""
        self.thread = threading.current_thread()
        try:
            while not self._ended.is_set() or not self._q.empty():
                try:
                    job = self._q.get(timeout=0.2)
                except queue.Empty:
                    continue
                if job is None:
                    continue
                if job.fn is not STEP:
                    job.run()
                    continue
                self._step, (indices, self.parts) = job, job.args
                yield indices
                self.stepped()  # a loop that did not step (no hook fired) still ends the step
        finally:
            self.close()

    def stepped(self, loss: float = math.nan) -> None:
        """The inner step in hand is done (called by the optimizer's step hook, or the loop)."""
        job, self._step = self._step, None
        if job is not None:
            job.result = float(loss)
            job.done.set()

    def end(self) -> None:
        """The node is done: serve() returns once the jobs in hand are run."""
        self._ended.set()
        self._q.put(None)

    def close(self) -> None:
        """The loop is done: jobs still asked for fail with SwarmClosed."""
        self._closed.set()
        self._ended.set()


class OnLoop:
    """A worker whose every call runs on the loop thread (see Steps); attributes read directly.
    train_step is the loop's own step."""

    def __init__(self, worker, steps: Steps) -> None:
        self._worker, self._steps = worker, steps

    def __getattr__(self, name: str):
        value = getattr(self._worker, name)
        if not callable(value):
            return value
        if name == "train_step":
            return self._steps.step
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
