"""`drift join` with one injected fault, for tests that must hit an exact moment whatever the
speed of the machine, or that need a node which misbehaves. $DRIFT_TEST_FAULT=KIND:ROUND names it:

  stop-in-allreduce    stop (SIGSTOP, as a closed laptop lid or a debugger would) as it is about
                       to send its first ring chunk of that round: the all-reduce cannot finish
                       (after one chunk it sometimes could: a tiny Δ fits in few chunks)
  stop-after-progress  stop right after reporting the first finished unit of that round
  nan-params           the model's weights turn NaN during that round (an fp16 overflow)
  nan-ring             send NaN in place of every reduce-scatter chunk of that round's all-reduce
                       (a hostile node: its own Δ and θ stay sound, so its own checks pass)
  tamper-forward       in that round's all-gather, alter one byte of every chunk it forwards of
                       another node's segment, and sign what it sent (its hop signature holds, the
                       owner's does not): before, its right neighbour alone ended with another θ
  short-chunks         send every ring chunk of that round one byte short
  equivocate           (sync: sparse) in that round's all-gather, send one peer (the one of the
                       largest id) a payload altered in its values, signed as its own, and the
                       others the real one: before, that peer alone ended with another θ
  false-sum            (sync: sparse, above the rule's fanout) in that round, send the block payload it
                       owes at every level above its own (drift/hierarchy.py) altered in its values,
                       alike to every member it sends it to, signed as its own for that level
  false-heard          (sync: sparse) from that round on, report in RoundDone.heard what the others
                       sent the round before (their real signatures, of another round)
  blip-in-allreduce    the ring connections break at the first chunk of that round's first
                       all-reduce attempt (a network blip), and the report of it takes 4 s to
                       reach the coordinator (a congested link): its retry arrives meanwhile
  deny-ring            finish that round's first all-reduce attempt, then report it failed 4 s
                       later instead of applying it (a node whose check of the sum failed, or a
                       liar): with two of three doing so, the third alone applied that attempt,
                       the coordinator redoes it without the third, which has synced the next
                       round by then
  lie-report           report, at that round's barrier, one of its units twice
  diverge              apply a different outer step in that round (θ no longer matches the swarm's)
  announce-wrong       in a ring of two, announce a wrong θ for that round's outer step, once (a
                       transient fault: the redo announces the honest one)
  slow-announce        in a ring of two, send the θ it announces for that round's outer step 3 s
                       late (the window a Ctrl-C must not mistake for an applied step)
  corrupt-theta        at that round's barrier its agreed θ changes in memory (one value + 1), so
                       its outer step starts from another state than the swarm's
  withhold-done        from that round on, never send RoundDone (θ after the outer step), heartbeating
                       on as if busy: the coordinator must not wait for it forever
  other-task           claim another initial θ in its RepoCommit (it loaded a different task); ROUND
                       is ignored
  claim-fast           claim 1e9 samples/s (calibration, every TrainProgress, and the time its
                       BarrierSync says it trained) while training at its real pace; ROUND is ignored
  eval-initial         answer every evaluation job as if it were of the initial θ (after_round -1);
                       ROUND is ignored
  val-every-round      report a val loss of 1e6 in every RoundDone it was not asked for one; ROUND
                       is ignored
  scale-ring           from that round on, send 1000 x its weighted Δ into the all-reduce while
                       reporting its true norm (a hostile node); flip-ring: -10 x; noise-ring:
                       Gaussian noise of 10 x its Δ's norm (either sync rule: the fault is in
                       Δ before the rule sees it, so sync: sparse sends it through its error feedback)
  sit-out-early        from that round on, the moment each all-reduce attempt starts, tell the
                       coordinator it already applied the round (RingFailed sit_out), then take
                       part anyway: before, the retry made every honest member sit out and the
                       coordinator ended the run ("every training node has left")
  lie-steps            from that round on, report at the barrier a Δ norm 1000 x its own over 10^9
                       inner steps, and send 1000 x its Δ into the all-reduce: before, the per-step
                       outlier check took its word for the steps and θ was poisoned
  sit-out-late         from that round on, in place of each RoundDone (θ after the outer step, which
                       it applied), tell the coordinator 0.3 s later that it sits the round out
                       (RingFailed sit_out): before, every such round was abandoned although every
                       node applied it, and the nodes deadlocked fetching the round before. (Within
                       the time the others' reports leave it: any later, it is behind already and
                       its claim is moot.)
  repeat-progress      from that round on, send each TrainProgress and each AskForMoreWork 20 times
                       (and, before its BarrierSync, a TrainProgress of every unit it lists, 20 times):
                       before, the repeats counted as measured speed and units, it became the only
                       trainer, and every honest node was made an evaluator
  withhold-gather      (sync: sparse) from that round on, send its payload to nobody in the
                       all-gather while receiving everyone's: before, the honest members waited
                       their 120 s timeout and were the ones struck (the withholder finished first)
  slow-serve           every piece of θ or outer state it serves (to a joiner, or to the coordinator
                       for a checkpoint) goes 1 s late, as over a slow uplink; ROUND is ignored
  late-sync            send its BarrierSync of that round 1.5 s late, heartbeating on (a last step
                       that stalled: a thermal throttle, a swap storm): the others are at the
                       barrier long before
  stop-reading         before its BarrierSync of that round, stop reading the control stream (QUIC
                       STOP_SENDING) and hang in that read, heartbeating on: every later send of the
                       coordinator to it fails

The test then kills, continues or watches the node. Everything else is the real `drift join`.
"""

import asyncio
import dataclasses
import hashlib
import os
import signal
import sys
import threading

import numpy as np
import sim_node  # noqa: F401 - a simulated device when $DRIFT_SIM_STEP is set

from drift import diloco
from drift import protocol as P
from drift.cli import main
from drift.gather import _HEADER as gather_header
from drift.gather import Gather
from drift.inner import InnerLoop
from drift.node import Session, Trainer
from drift.ring import Ring, RingError
from drift.state import StateServer
from drift.sync import rules
from drift.transport import Channel, TransportError

kind, _, arg = os.environ["DRIFT_TEST_FAULT"].partition(":")
at = int(arg)


def stop() -> None:
    """SIGSTOP, taken by the calling thread itself: sent to the process, it is taken by whichever
    thread the kernel picks (the training thread, say), and until that one runs the node's own
    thread went on sending (seen on a loaded machine: three more ring chunks)."""
    signal.pthread_kill(threading.get_ident(), signal.SIGSTOP)


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
        if round_ == at:
            stop()
        await orig(self, ch, payload, codec, round_, *rest)
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

    @patch(Ring, "_send_chunk")
    async def _(orig, self, ch, payload, codec, round_, step, chunk, n, total, signed=None, **kw):
        if round_ == at and signed is None:  # (fp32: a payload of float32 values)
            payload = np.full(memoryview(payload).nbytes // 4, np.nan, np.float32)
        await orig(self, ch, payload, codec, round_, step, chunk, n, total, signed, **kw)
elif kind == "tamper-forward":

    @patch(Ring, "_send_chunk")
    async def _(orig, self, ch, payload, codec, round_, step, chunk, n, total, signed=None, **kw):
        owner = signed[0][-64:-32].hex() if signed is not None else None
        if round_ == at and owner is not None and owner != self.node_id:
            forged = bytearray(memoryview(payload).cast("B"))
            forged[0] ^= 1  # (the lowest bit of a float32: finite, and nearly the same θ)
            signed = (signed[0][:-32] + hashlib.sha256(forged).digest(), signed[1])
            payload = forged
        await orig(self, ch, payload, codec, round_, step, chunk, n, total, signed, **kw)
elif kind == "equivocate":
    misled: dict[int, str] = {}  # round -> the one peer that gets the other payload

    @patch(Gather, "exchange")
    async def _(orig, self, payload, take, give, round_, *args):
        if round_ == at:
            misled[round_] = max((m.node_id for m in give), default="")
        return await orig(self, payload, take, give, round_, *args)

    @patch(Gather, "_send")
    async def _(orig, self, m, head, payload, count):
        _, _, rnd, gen, *_, level = gather_header.unpack(head)
        if payload and misled.get(rnd) == m.node_id:
            # halve the first chunk's two magnitudes: it still decodes, and moves θ well past a
            # rounding error (a flipped low mantissa bit often vanished in θ's float32 sum)
            scales = np.frombuffer(payload, "<f4", count=2) / np.float32(2)
            payload = scales.tobytes() + payload[8:]
            head = self.header(rnd, gen, payload, level)  # signed with its own key, as an honest payload is
        await orig(self, m, head, payload, count)
elif kind == "false-sum":

    @patch(Gather, "_send")
    async def _(orig, self, m, head, payload, count):
        _, _, rnd, gen, *_, level = gather_header.unpack(head)
        if payload and rnd == at and level >= 1:
            scales = np.frombuffer(payload, "<f4", count=2) / np.float32(2)  # (as equivocate's)
            payload = scales.tobytes() + payload[8:]
            head = self.header(rnd, gen, payload, level)
        await orig(self, m, head, payload, count)
elif kind == "false-heard":
    heard_before: list[list[P.Heard]] = [[]]

    @patch(Session, "send")
    async def _(orig, self, msg):
        if isinstance(msg, P.RoundDone) and msg.heard:
            real = msg.heard
            if msg.round >= at:
                lie = heard_before[0] or [h.model_copy(update={"digest": "0" * 64}) for h in real]
                msg = msg.model_copy(update={"heard": lie})
            heard_before[0] = real
        await orig(self, msg)
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
elif kind == "deny-ring":
    denied = False

    @patch(Session, "_allreduce")
    async def _(orig, self, t, ready):
        global denied
        out = await orig(self, t, ready)
        if ready.msg.round == at and not denied:
            denied = True
            await asyncio.sleep(4.0)
            return (*out[:4], None, RingError("injected: the sum did not check out"))
        return out
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
elif kind == "slow-serve":

    @patch(StateServer, "_send_piece")
    async def _send_piece(original, self, ch, data, timeout):
        await asyncio.sleep(1.0)
        await original(self, ch, data, timeout)

elif kind == "late-sync":

    @patch(Session, "send")
    async def _(orig, self, msg):
        if isinstance(msg, P.BarrierSync) and msg.round == at:
            await asyncio.sleep(1.5)
        await orig(self, msg)
elif kind == "stop-reading":
    stopped: list[Channel] = []

    @patch(Session, "send")
    async def _(orig, self, msg):
        if isinstance(msg, P.BarrierSync) and msg.round == at and not stopped:
            stopped.append(self.ctl)
            await self.ctl._recv.stop(0)  # (after the read in flight: the next Ping ends it)
        await orig(self, msg)

    @patch(Channel, "recv_frame")
    async def _(orig, self, max_size, timeout=30.0):
        if self not in stopped:
            try:
                return await orig(self, max_size, timeout)
            except Exception:
                if self not in stopped:  # (the read in flight fails when the stream is stopped)
                    raise
        await asyncio.Event().wait()
elif kind == "withhold-done":

    @patch(Session, "send")
    async def _(orig, self, msg):
        if not (isinstance(msg, P.RoundDone) and msg.round >= at):
            await orig(self, msg)
elif kind == "other-task":

    @patch(Session, "_repo_commit")
    def _(orig, self, t):
        t.initial_checksum = "0" * 64
        return orig(self, t)
elif kind == "claim-fast":

    @patch(Session, "_repo_commit")
    def _(orig, self, t):
        t.calibration = dataclasses.replace(t.calibration, samples_per_s=1e9)
        return orig(self, t)

    @patch(Session, "send")
    async def _(orig, self, msg):
        if isinstance(msg, (P.TrainProgress, P.EvalResult)):
            msg = msg.model_copy(update={"samples_per_s": 1e9})
        if isinstance(msg, P.BarrierSync):  # (the speed it shows for the units only its sync reports)
            msg = msg.model_copy(update={"busy_s": msg.samples / 1e9})
        await orig(self, msg)
elif kind in ("eval-initial", "val-every-round"):

    @patch(Session, "send")
    async def _(orig, self, msg):
        if kind == "eval-initial" and isinstance(msg, P.EvalResult):
            msg = msg.model_copy(update={"after_round": -1, "val_loss": 1e6})
        if kind == "val-every-round" and isinstance(msg, P.RoundDone) and msg.val_loss is None:
            msg = msg.model_copy(update={"val_loss": 1e6})
            print(f"fault: round {msg.round}: RoundDone with a val loss nobody asked for", flush=True)
        await orig(self, msg)
elif kind in ("scale-ring", "flip-ring", "noise-ring"):

    def hostile(orig, self, delta, weight, rnd):
        if rnd >= at and weight > 0:  # (before the rule sees it: either rule)
            if kind == "scale-ring":
                delta *= np.float32(1000)
            elif kind == "flip-ring":
                delta *= np.float32(-10)
            else:
                norm = float(np.linalg.norm(delta))
                noise = np.random.default_rng().standard_normal(delta.size).astype(np.float32)
                delta += noise * np.float32(10 * norm / float(np.linalg.norm(noise)))
        return orig(self, delta, weight, rnd)

    for rule in rules().values():
        patch(rule, "contribute")(hostile)
elif kind == "announce-wrong":
    wrong = [True]

    @patch(rules()["dense"], "preview")
    def _(orig, self, theta):
        honest = orig(self, theta)
        if Session.current_round == at and wrong:
            wrong.pop()
            return "0" * len(honest)  # once: a transient fault (the redo must find the honest θ)
        return honest

    @patch(Session, "_round")
    async def _(orig, self, a):
        Session.current_round = a.round
        return await orig(self, a)
elif kind == "slow-announce":

    @patch(Session, "send")
    async def _(orig, self, msg):
        if isinstance(msg, P.RoundDone) and msg.announced and msg.round == at:
            await asyncio.sleep(3.0)
        await orig(self, msg)
elif kind == "corrupt-theta":
    corrupt = [True]

    @patch(Trainer, "pseudo_gradient")
    def _(orig, self, local=None):
        if Session.current_round == at and corrupt:
            corrupt.pop()
            self.theta[0] += np.float32(1.0)  # its agreed θ changed in memory (a bit flip, a bug)
        return orig(self, local)

    @patch(Session, "_round")
    async def _(orig, self, a):
        Session.current_round = a.round
        return await orig(self, a)
elif kind == "sit-out-early":

    @patch(Session, "_allreduce")
    async def _(orig, self, t, ready):
        if ready.msg.round >= at:
            lie = P.RingFailed(round=ready.msg.round, ring_epoch=ready.msg.ring_epoch, reason="applied", sit_out=True)
            await self.send(lie)
        return await orig(self, t, ready)
elif kind == "lie-steps":

    @patch(Session, "send")
    async def _(orig, self, msg):
        if isinstance(msg, P.BarrierSync) and msg.round >= at and msg.delta_norm:
            msg = msg.model_copy(update={"steps": 10**9, "delta_norm": 1000 * msg.delta_norm})
        await orig(self, msg)

    def scaled(orig, self, delta, weight, rnd):
        if rnd >= at and weight > 0:
            delta *= np.float32(1000)
        return orig(self, delta, weight, rnd)

    for rule in rules().values():
        patch(rule, "contribute")(scaled)
elif kind == "sit-out-late":

    @patch(Session, "send")
    async def _(orig, self, msg):
        if isinstance(msg, P.RoundDone) and msg.round >= at:
            await asyncio.sleep(0.3)
            msg = P.RingFailed(round=msg.round, ring_epoch=msg.ring_epoch, reason="applied", sit_out=True)
        await orig(self, msg)
elif kind == "repeat-progress":

    @patch(Session, "send")
    async def _(orig, self, msg):
        repeats = 20 if isinstance(msg, (P.TrainProgress, P.AskForMoreWork)) and msg.round >= at else 1
        if isinstance(msg, P.BarrierSync) and msg.round >= at:  # the units only its sync reports, too
            for u in msg.trained:
                progress = P.TrainProgress(round=msg.round, units=[u], steps=1, loss=msg.loss, samples_per_s=1.0)
                for _ in range(20):
                    await orig(self, progress)
        for _ in range(repeats):
            await orig(self, msg)
elif kind == "withhold-gather":

    @patch(Gather, "_send")
    async def _(orig, self, m, head, payload, count):
        if gather_header.unpack(head)[2] >= at:
            await asyncio.Event().wait()  # (until the attempt is cancelled: a newer ring, or the end)
        await orig(self, m, head, payload, count)
else:
    raise SystemExit(f"unknown DRIFT_TEST_FAULT {kind!r}")

sys.exit(main(sys.argv[1:], prog_name="drift"))
