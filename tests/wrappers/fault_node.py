"""`drift join` with one injected fault, for tests that must hit an exact moment whatever the
speed of the machine, or that need a node which misbehaves. $DRIFT_TEST_FAULT=KIND:ROUND names it:

  stop-in-allreduce    stop (SIGSTOP, as a closed laptop lid or a debugger would) right after
                       sending the first ring chunk of that round: the all-reduce cannot finish
  stop-after-progress  stop right after reporting the first finished unit of that round
  nan-params           the model's weights turn NaN during that round (an fp16 overflow)
  nan-ring             send NaN as this node's contribution to that round's all-reduce, past its
                       own check (a broken or hostile node)
  short-chunks         send every ring chunk of that round one byte short
  blip-in-allreduce    the ring connections break at the first chunk of that round's first
                       all-reduce attempt (a network blip), and the report of it takes 4 s to
                       reach the coordinator (a congested link): its retry arrives meanwhile
  lie-report           report, at that round's barrier, one of its units twice
  diverge              apply a different outer step in that round (θ no longer matches the swarm's)

The test then kills, continues or watches the node. Everything else is the real `drift join`.
"""

import asyncio
import os
import signal
import sys

import numpy as np
import sim_node  # noqa: F401 - a simulated device when $DRIFT_SIM_STEP is set

from drift import diloco
from drift import protocol as P
from drift.cli import main
from drift.inner import InnerLoop
from drift.node import Session
from drift.ring import Ring
from drift.transport import TransportError

kind, _, arg = os.environ["DRIFT_TEST_FAULT"].partition(":")
at = int(arg)


def stop() -> None:
    os.kill(os.getpid(), signal.SIGSTOP)


def patch(cls, name: str):
    original = getattr(cls, name)

    def wrap(fn):
        def wrapper(*args, **kwargs):
            return fn(original, *args, **kwargs)

        setattr(cls, name, wrapper)
        return fn

    return wrap


if kind == "stop-in-allreduce":

    @patch(Ring, "_send_chunk")
    async def _(orig, self, ch, payload, codec, round_, *rest):
        await orig(self, ch, payload, codec, round_, *rest)
        if round_ == at:
            stop()
elif kind == "stop-after-progress":

    @patch(Session, "send")
    async def _(orig, self, msg):
        await orig(self, msg)
        if isinstance(msg, P.TrainProgress) and msg.round == at:
            stop()
elif kind == "nan-params":

    @patch(InnerLoop, "run_round")
    async def _(orig, self, a):
        report = await orig(self, a)
        if a.round == at:
            params = self.worker.get_params()
            name = sorted(params)[0]
            params[name][...] = np.nan
            self.worker.set_params(params)
        return report
elif kind == "nan-ring":

    @patch(Session, "_allreduce")
    async def _(orig, self, t, ready):
        if ready.round != at:
            return await orig(self, t, ready)
        honest = t.rule.contribute
        t.rule.contribute = lambda delta, weight: (honest(delta, weight), delta.fill(np.nan))
        try:
            return await orig(self, t, ready)
        finally:
            del t.rule.contribute  # back to the class's
elif kind == "short-chunks":

    @patch(Ring, "_send_chunk")
    async def _(orig, self, ch, payload, codec, round_, *rest):
        if round_ == at:
            payload = memoryview(payload).cast("B")[:-1]
        await orig(self, ch, payload, codec, round_, *rest)
elif kind == "blip-in-allreduce":
    blipped = False

    @patch(Ring, "_send_chunk")
    async def _(orig, self, ch, payload, codec, round_, *rest):
        global blipped
        if round_ == at and not blipped:
            blipped = True
            raise TransportError("injected network blip")
        await orig(self, ch, payload, codec, round_, *rest)

    @patch(Session, "send")
    async def _(orig, self, msg):
        if isinstance(msg, P.RingFailed) and msg.round == at:
            await asyncio.sleep(4.0)
        await orig(self, msg)
elif kind == "lie-report":

    @patch(Session, "send")
    async def _(orig, self, msg):
        if isinstance(msg, P.BarrierSync) and msg.round == at and msg.trained:
            extra = msg.trained[0]  # a well-formed message that lies (samples match the units listed)
            msg = msg.model_copy(
                update={"trained": [*msg.trained, extra], "samples": msg.samples + extra.hi - extra.lo}
            )
        await orig(self, msg)
elif kind == "diverge":

    @patch(diloco.NesterovOuter, "step")
    def _(orig, self, theta, grad):
        orig(self, theta, grad)
        if Session.current_round == at:
            theta[0] += 1.0

    @patch(Session, "_round")
    async def _(orig, self, a):
        Session.current_round = a.round
        return await orig(self, a)
else:
    raise SystemExit(f"unknown DRIFT_TEST_FAULT {kind!r}")

sys.exit(main(sys.argv[1:], prog_name="drift"))
