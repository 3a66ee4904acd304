"""`drift join` on a simulated device: with $DRIFT_SIM_STEP=S every inner step of this node takes
exactly S seconds, per round ("0.1", or "0.1,0.1,2" to slow down from round 2 on; the last one
holds), by sleeping out the rest of the real step; an evaluation batch takes S over the node's
calibrated ratio of a step to an evaluation batch (so its speed, measured from evaluations, is
the simulated one: a slow device evaluates slowly too). So one 2-core
machine can play a swarm of very different devices, and a simulation means the same on any
machine that computes a real step faster than S.

It is `drift join` with its own loop (drift.loop.run_join's, plus the sleep): the node code is
drift's, untouched. Other wrappers import this module to be simulated too (fault_node.py).
With $DRIFT_TEST_THETA=FILE.npz a node that completed the run saves its model's parameters and
buffers there, so a test can compare the nodes' models itself."""

from __future__ import annotations

import math
import os
import sys
import time
from dataclasses import dataclass

import numpy as np

from drift import loop
from drift.cli import main


@dataclass(frozen=True)
class SimDevice:
    steps: tuple[float, ...]

    @classmethod
    def parse(cls, spec: str) -> SimDevice:
        steps = tuple(float(x) for x in spec.split(","))
        if not steps or any(not (0 < s < 86400) or not math.isfinite(s) for s in steps):
            raise SystemExit(f"DRIFT_SIM_STEP={spec!r}: seconds per inner step > 0, like 0.1 or 0.1,0.1,2")
        return cls(steps)

    def step_s(self, rnd: int) -> float:
        return self.steps[min(max(rnd, 0), len(self.steps) - 1)]


def _round(s: loop.NodeThread) -> int:
    t = s.node.trainer if s.node is not None else None
    return t.inner.round if t is not None and t.inner is not None else 0


def _eval_share(s: loop.NodeThread) -> float:
    """An evaluation batch's share of a training step, as the node calibrated it (drift measures
    an evaluator's speed through it)."""
    calibration = getattr(s.node.trainer if s.node is not None else None, "calibration", None)
    return 1 / calibration.eval_ratio if calibration is not None else 1 / 3


def run_join(opts) -> int:
    sim = SimDevice.parse(os.environ["DRIFT_SIM_STEP"])
    with loop.NodeThread(opts) as s:
        slowed = None
        for indices in s.batches():
            worker = opts.source.worker
            if slowed is not worker:  # its evaluations take their simulated time too
                evaluate, slowed = worker.evaluate, worker

                def slow_evaluate(max_batches, batch_size, evaluate=evaluate, n_val=worker.n_val):
                    t0 = time.perf_counter()
                    out = evaluate(max_batches, batch_size)
                    batches = max(1, -(-min(n_val, max_batches * batch_size) // batch_size))
                    time.sleep(max(0.0, batches * sim.step_s(_round(s)) * _eval_share(s) - (time.perf_counter() - t0)))
                    return out

                worker.evaluate = slow_evaluate
            t0 = time.perf_counter()
            loss = worker.train_step(indices, s.micro_batches)
            time.sleep(max(0.0, sim.step_s(_round(s)) - (time.perf_counter() - t0)))
            s.stepped(loss)
        if s.code == 0 and os.environ.get("DRIFT_TEST_THETA"):  # the model as the run left it, for a test to compare
            worker = opts.source.worker
            np.savez(os.environ["DRIFT_TEST_THETA"], **worker.get_params(), **worker.get_buffers())
    return s.code if s.code is not None else 1


if os.environ.get("DRIFT_SIM_STEP"):
    loop.run_join = run_join

if __name__ == "__main__":
    sys.exit(main(sys.argv[1:], prog_name="drift"))
