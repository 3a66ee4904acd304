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
import math
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Awaitable, Callable

import numpy as np

from drift import protocol as P
from drift.diloco import epoch_order, unit_indices


class StopTraining(Exception):
    """The coordinator cancelled the run or went away."""


@dataclass
class RoundReport:
    samples: int = 0
    steps: int = 0
    losses: list[float] = field(default_factory=list)
    trained: list[P.WorkUnit] = field(default_factory=list)
    returned: list[P.WorkUnit] = field(default_factory=list)
    val_loss: float | None = None     # report_val in round 0: the loss of the initial θ
    val_samples: int = 0

    def barrier_sync(self, rnd: int) -> P.BarrierSync:
        return P.BarrierSync(round=rnd, samples=self.samples, steps=self.steps,
                             loss=float(np.mean(self.losses)) if self.losses else None,
                             trained=self.trained, returned=self.returned,
                             val_loss=self.val_loss, val_samples=self.val_samples)


@dataclass
class SpeedSchedule:
    """Simulations only: a speed factor per round, e.g. "1" or "1,1,0.25" (the last one holds).
    A factor f < 1 makes every inner step last 1/f of the node's calibrated (uncontended) step
    time, by sleeping out the rest: a fixed target, so other processes fighting for the same cores
    do not slow the simulated device down further unless they push a step past that target."""

    factors: tuple[float, ...] = (1.0,)

    @classmethod
    def parse(cls, spec: str) -> "SpeedSchedule":
        try:
            factors = tuple(float(x) for x in spec.split(","))
        except ValueError:
            raise ValueError(f"--speed {spec!r}: expected numbers like 0.25 or 1,1,0.25") from None
        if not factors or any(not (0 < f <= 1) for f in factors):
            raise ValueError(f"--speed {spec!r}: each factor must be in (0, 1]")
        return cls(factors)

    def at(self, rnd: int) -> float:
        return self.factors[min(rnd, len(self.factors) - 1)]


class InnerLoop:
    """Runs rounds for one node; the worker does the math, this decides what to train when."""

    def __init__(self, worker, recipe, inbox: asyncio.Queue, send: Callable[[P._Msg], Awaitable[None]],  # noqa: ANN001
                 speed: SpeedSchedule = SpeedSchedule(), real_step_s: float = 0.0):
        self.worker = worker
        self.real_step_s = real_step_s  # calibrated, unstretched: the base of simulated slowness
        self.recipe = recipe
        self.inbox = inbox
        self.send = send
        self.speed = speed
        self._orders: dict[int, np.ndarray] = {}
        self.step_s = 0.0          # EMA of one inner step, stretched (what the swarm sees)
        self.rtt_s = 0.05          # EMA of AskForMoreWork -> reply

    async def _step(self, fn, *args) -> float:  # noqa: ANN001
        """Run one worker call off the event loop (so heartbeats and messages keep flowing)."""
        t0 = time.perf_counter()
        out = await asyncio.get_running_loop().run_in_executor(None, fn, *args)
        if self._factor < 1.0:  # a simulated slower device
            took = time.perf_counter() - t0
            if fn == self.worker.train_step and self.real_step_s > 0:
                await asyncio.sleep(max(0.0, self.real_step_s / self._factor - took))
            else:
                await asyncio.sleep(took * (1 / self._factor - 1))
        return out

    def _order(self, epoch: int) -> np.ndarray:
        if epoch not in self._orders:
            self._orders = {epoch: epoch_order(self.worker.n_train, self.recipe.seed, epoch)}
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
            raise StopTraining("coordinator closed the connection")
        if isinstance(msg, P.TrainingCancel):
            raise StopTraining(f"training cancelled by coordinator: {msg.reason}")
        if getattr(msg, "round", state["round"]) != state["round"]:
            return  # a late reply to the previous round
        if isinstance(msg, P.AssignNext):
            state["granted"].append(msg.unit)
            state["asked"] = False
            self.rtt_s = 0.8 * self.rtt_s + 0.2 * (time.perf_counter() - state["asked_at"])
        elif isinstance(msg, P.NoMoreWork):
            state["no_more"] = True
            state["asked"] = False
        elif isinstance(msg, P.StopRound):
            state["stop"] = True

    async def run_round(self, a: P.ShardAssignment) -> RoundReport:
        self._factor = self.speed.at(a.round)
        report = RoundReport()
        if a.report_val and a.round == 0:  # the loss before any training, for the record
            report.val_loss = await self._step(self.worker.evaluate, self.recipe.eval_batches,
                                               self.recipe.batch_size)
            report.val_samples = min(self.worker.n_val, self.recipe.eval_batches * self.recipe.batch_size)
        state = {"round": a.round, "granted": deque(a.units), "asked": False, "asked_at": 0.0,
                 "no_more": False, "stop": False}
        bs = self.recipe.batch_size
        order = self._order(a.epoch)
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
            idx = unit_indices(order, unit, self.recipe.unit_samples)
            t0, lo, u_losses = time.perf_counter(), unit.lo, []
            while lo < unit.hi:
                # Ask ahead: the steps still in hand should cover a round trip to the coordinator.
                left = (unit.hi - lo) // bs + sum((u.hi - u.lo) // bs for u in state["granted"])
                if not state["asked"] and not state["no_more"] and \
                        left * self.step_s <= max(self.rtt_s * 2, self.step_s):
                    await self._ask(state)
                t_step = time.perf_counter()
                hi = min(lo + bs, unit.hi)
                u_losses.append(await self._step(self.worker.train_step, idx[lo - unit.lo:hi - unit.lo]))
                dt = time.perf_counter() - t_step
                self.step_s = dt if self.step_s == 0 else 0.7 * self.step_s + 0.3 * dt
                lo = hi
                self._poll(state)
                if state["stop"]:
                    break
            if lo > unit.lo:
                done = P.WorkUnit(id=unit.id, lo=unit.lo, hi=lo)
                report.trained.append(done)
                report.samples += lo - unit.lo
                report.steps += len(u_losses)
                report.losses += u_losses
                await self.send(P.TrainProgress(round=a.round, unit=done, steps=len(u_losses),
                                                loss=float(np.mean(u_losses)),
                                                samples_per_s=(lo - unit.lo) / (time.perf_counter() - t0)))
            if lo < unit.hi:
                report.returned.append(P.WorkUnit(id=unit.id, lo=lo, hi=unit.hi))
        report.returned += list(state["granted"])
        if state["asked"]:  # a grant may still be on its way: wait for it so it is handed back
            while state["asked"]:
                self._apply(await self.inbox.get(), state)
            report.returned += list(state["granted"])
        return report

    async def _ask(self, state: dict) -> None:
        state["asked"], state["asked_at"] = True, time.perf_counter()
        await self.send(P.AskForMoreWork(round=state["round"]))

    async def evaluate(self, rnd: int) -> float:
        """Validation loss of the worker's θ (an evaluator's job; at the node's own pace)."""
        self._factor = self.speed.at(rnd)
        return await self._step(self.worker.evaluate, self.recipe.eval_batches, self.recipe.batch_size)


def finite_positive(x: float | None) -> bool:
    return x is not None and math.isfinite(x) and x > 0


async def calibrate(worker, recipe, speed: SpeedSchedule = SpeedSchedule(), steps: int = 3) -> tuple[float, float]:  # noqa: ANN001
    """(samples/s, real seconds per step) on the real task: one warm-up step, then the fastest of
    `steps` timed ones (robust to a busy moment); samples/s is that of a simulated slow node in
    round 0. The caller restores θ afterwards."""
    loop = asyncio.get_running_loop()
    idx = np.arange(min(recipe.batch_size, worker.n_train))
    await loop.run_in_executor(None, worker.train_step, idx)
    times = []
    for _ in range(steps):
        t0 = time.perf_counter()
        await loop.run_in_executor(None, worker.train_step, idx)
        times.append(time.perf_counter() - t0)
    real = min(times)
    return len(idx) / (real / speed.at(0)), real
