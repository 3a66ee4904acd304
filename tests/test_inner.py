"""A node's share of a round (drift/inner.py) when control messages cross each other, as they do
all the time on fast devices: the test plays the coordinator's side of the protocol and delivers
its replies in exactly the orders that steps of a millisecond produce. The node must account for
every granted sample exactly once (trained, or returned), or the coordinator throws away its
whole round as a bad report."""

from __future__ import annotations

import asyncio
import threading
import time
from pathlib import Path

import pytest
from conftest import run_async

from drift import protocol as P
from drift.inner import InnerLoop, OnLoop, Steps
from drift.recipe import Recipe
from drift.scheduler import check_accounting
from drift.workers import load_task, make_worker

TASK = Path(__file__).parent / "tasks" / "points_mlp.py"
BATCH = 16


@pytest.fixture(scope="module")
def worker():
    return make_worker(load_task(TASK), {"hidden": 8}, {"lr": 0.01}, backend="torch", device="cpu", threads=1)


def _unit(uid: int, steps: int = 2) -> P.WorkUnit:
    return P.WorkUnit(id=uid, lo=0, hi=steps * BATCH)


class Device:
    """The test's worker as the node sees it, with what the coordinator sends `during_step()`
    delivered while the device's next inner step runs (that step is then in flight, as it is
    when a message crosses a step on a real device)."""

    def __init__(self, worker) -> None:
        self.worker = worker
        self._during: list[tuple[int | None, P._Msg]] = []
        self._deliver = None
        self.steps = 0

    def __getattr__(self, name: str):
        return getattr(self.worker, name)

    def during_step(self, inbox: asyncio.Queue, msg: P._Msg, step: int | None = None) -> None:
        """`msg` comes during the next step, or during the device's `step`-th (from 1)."""
        loop = asyncio.get_running_loop()
        self._deliver = lambda m: loop.call_soon_threadsafe(inbox.put_nowait, m)
        self._during.append((step, msg))

    def train_step(self, indices, micro_batches: int = 1) -> float:
        loss = self.worker.train_step(indices, micro_batches)
        self.steps += 1
        due = [m for at, m in self._during if at in (None, self.steps)]
        self._during = [(at, m) for at, m in self._during if at not in (None, self.steps)]
        for m in due:
            self._deliver(m)
        return loss


async def _round(
    worker,
    first: list[P.WorkUnit],
    replies,
    unit_steps: int = 2,
    rnd: int = 0,
    rtt_s: float = 60.0,
    report_s: float = 0.0,
    sent=None,
    no_more: bool = False,
    waiting: list[P._Msg] = (),
    during: P._Msg | None = None,
    during_step: int | None = None,
):
    """Run one round; `replies(ask_count, inbox)` is the coordinator's answer to each ask (an
    AskForMoreWork, or one riding on a TrainProgress); `sent` collects what the node sent.
    `report_s`: units this short wait for the next report (default 0: each unit reports alone)."""
    recipe = Recipe(
        name="t", task="t.py", min_nodes=1, rounds=1, inner_steps=4, batch_size=BATCH, unit_steps=unit_steps
    )
    inbox: asyncio.Queue = asyncio.Queue()
    for m in waiting:  # (came before the round's first step)
        inbox.put_nowait(m)
    if during is not None:  # (comes during the first step)
        worker = Device(worker)
        worker.during_step(inbox, during, during_step)
    asks = 0
    sent = [] if sent is None else sent

    async def send(msg: P._Msg) -> None:
        nonlocal asks
        sent.append(msg)
        if isinstance(msg, P.AskForMoreWork) or (isinstance(msg, P.TrainProgress) and msg.ask):
            asks += 1
            replies(asks, inbox)

    inner = InnerLoop(worker, recipe, inbox, send)
    inner.rtt_s = rtt_s  # default: a slow link next to a fast device: the node asks ahead at every step
    inner.report_s = report_s
    report = await inner.run_round(P.ShardAssignment(round=rnd, epoch=0, units=first, no_more=no_more))
    return report


def _later(inbox: asyncio.Queue, msg: P._Msg, delay: float = 0.05) -> None:
    asyncio.get_running_loop().call_later(delay, inbox.put_nowait, msg)


def test_stop_round_that_crosses_a_grant(worker) -> None:
    """StopRound arrives during a step while the node waits for the answer to its ask, and the
    answer is one more unit: the steps done count, that unit and the ones in hand are handed back
    once each."""
    granted, device = [_unit(0), _unit(1)], Device(worker)

    def replies(n: int, inbox: asyncio.Queue) -> None:
        device.during_step(inbox, P.StopRound(round=0))
        granted.append(_unit(2 + n))
        _later(inbox, P.AssignNext(round=0, units=[granted[-1]]))

    report = run_async(_round(device, granted[:2], replies))
    assert check_accounting(granted, report.trained, report.returned) is None, (report.trained, report.returned)
    assert report.trained and report.samples == sum(u.hi - u.lo for u in report.trained)


def test_stop_round_that_crosses_no_more_work(worker) -> None:
    granted, device = [_unit(0), _unit(1)], Device(worker)

    def replies(n: int, inbox: asyncio.Queue) -> None:
        device.during_step(inbox, P.StopRound(round=0))
        _later(inbox, P.NoMoreWork(round=0))

    report = run_async(_round(device, granted, replies))
    assert check_accounting(granted, report.trained, report.returned) is None, (report.trained, report.returned)


def test_grants_until_no_more_work_train_everything(worker) -> None:
    """No StopRound: every unit granted, in hand or in flight, is trained, none twice."""
    granted = [_unit(0)]

    def replies(n: int, inbox: asyncio.Queue) -> None:
        if n <= 3:
            granted.append(_unit(n))
            _later(inbox, P.AssignNext(round=0, units=[granted[-1]]), 0.01)
        else:
            _later(inbox, P.NoMoreWork(round=0), 0.01)

    report = run_async(_round(worker, granted[:1], replies))
    assert check_accounting(granted, report.trained, report.returned) is None
    assert report.returned == [] and sorted(u.id for u in report.trained) == [0, 1, 2, 3]


def test_a_node_told_nothing_is_left_trains_its_units_without_asking(worker) -> None:
    """A grant that says nothing is left after it (`no_more`): no ask, every unit trained."""
    sent: list[P._Msg] = []

    def replies(n: int, inbox: asyncio.Queue) -> None:
        raise AssertionError("the node asked although nothing is left")

    report = run_async(_round(worker, [_unit(0), _unit(1)], replies, sent=sent, no_more=True))
    assert sorted(u.id for u in report.trained) == [0, 1] and report.returned == []
    # The first unit's report goes at once; the last one's rides on the barrier report (it lists
    # that unit), one frame a node less: kept in the report, for when the barrier has to wait.
    assert [(type(m), m.units) for m in sent] == [(P.TrainProgress, [_unit(0)])], sent
    assert [m.units for m in report.unsent] == [[_unit(1)]] and _unit(1) in report.trained


def test_a_node_told_nothing_is_left_asks_again_when_units_come_back(worker) -> None:
    granted = [_unit(0), _unit(1)]

    def replies(n: int, inbox: asyncio.Queue) -> None:
        assert n == 1, "the node asked again after it was told nothing is left"
        granted.append(_unit(2))  # (the unit of a node that left)
        _later(inbox, P.AssignNext(round=0, units=[granted[-1]], no_more=True), 0.01)

    for when in ("waiting", "during"):
        del granted[2:]
        msg = {when: [P.MoreWork(round=0)] if when == "waiting" else P.MoreWork(round=0)}
        report = run_async(_round(worker, granted[:2], replies, no_more=True, **msg))
        assert check_accounting(granted, report.trained, report.returned) is None
        assert sorted(u.id for u in report.trained) == [0, 1, 2], when


def test_a_report_waits_for_the_barrier_only_when_the_round_ended_with_its_unit(worker) -> None:
    """Units come back (MoreWork) while the last unit in hand trains its last step: that unit was
    not the round's last after all, so its report goes at once; only the unit the round really
    ended with waits for the barrier report. (Held back, the coordinator would wait for its
    progress before it granted more, and the node for the grant.)"""
    granted, sent = [_unit(0), _unit(1), _unit(2)], []

    def replies(n: int, inbox: asyncio.Queue) -> None:
        assert n == 1, "the node asked again after the last grant"
        _later(inbox, P.AssignNext(round=0, units=[granted[2]], no_more=True), 0.01)

    # (step 4: unit 1's last; a node left, its unit is back in the plan)
    more = {"during": P.MoreWork(round=0), "during_step": 4}
    report = run_async(_round(worker, granted[:2], replies, sent=sent, no_more=True, **more))
    assert check_accounting(granted, report.trained, report.returned) is None
    assert [m.units for m in sent if isinstance(m, P.TrainProgress)] == [[_unit(0)], [_unit(1)]], sent
    assert [m.units for m in report.unsent] == [[_unit(2)]]


def test_units_back_after_the_round_seemed_over_send_the_kept_reports_the_last_with_the_ask(worker) -> None:
    """The node kept the reports of the units it thought it ended its round with; then units came
    back (MoreWork) and it asks: the kept reports go as one, in order, carrying the ask (one
    frame, not three). (Kept back, the coordinator would count them only at the barrier.)
    The moment between a job's last step and the round loop's next look at its inbox cannot be
    hit by timing: this drives the ask itself."""
    sent: list[P._Msg] = []

    async def send(msg: P._Msg) -> None:
        sent.append(msg)

    recipe = Recipe(name="t", task="t.py", min_nodes=1, rounds=1, inner_steps=4, batch_size=BATCH, unit_steps=2)
    inner = InnerLoop(worker, recipe, asyncio.Queue(), send)
    kept = [P.TrainProgress(round=0, units=[_unit(k)], steps=2, loss=1.0, samples_per_s=1.0) for k in (0, 1)]
    state = {"round": 0, "unsent": list(kept), "asked": False, "reported_at": 0.0}
    run_async(inner._ask(state))
    assert [(m.units, m.steps, m.ask) for m in sent] == [([_unit(0), _unit(1)], 4, True)], sent
    assert state["unsent"] == [] and state["asked"] and state["reported_at"] > 0


def test_the_grant_of_the_last_unit_ends_the_asks(worker) -> None:
    granted, sent = [_unit(0)], []

    def replies(n: int, inbox: asyncio.Queue) -> None:
        assert n == 1, "the node asked after the last unit was granted"
        granted.append(_unit(1))
        _later(inbox, P.AssignNext(round=0, units=[granted[-1]], no_more=True), 0.01)

    report = run_async(_round(worker, granted[:1], replies, sent=sent))
    assert check_accounting(granted, report.trained, report.returned) is None
    assert sorted(u.id for u in report.trained) == [0, 1]


class Slow(Device):
    """A device whose steps take 25 ms: the node's loop is always ahead of it."""

    def train_step(self, indices, micro_batches: int = 1) -> float:
        time.sleep(0.025)
        return super().train_step(indices, micro_batches)


def test_a_node_asks_for_its_next_unit_on_the_report_of_the_last_one(worker) -> None:
    """On a quick link each unit's report carries the ask for the one after next (one frame a
    unit, not two): once a unit ended, no ask is a frame of its own."""
    granted, device, sent = [_unit(0)], Slow(worker), []

    def replies(n: int, inbox: asyncio.Queue) -> None:
        if n <= 6:
            granted.append(_unit(n))
            device.during_step(inbox, P.AssignNext(round=0, units=[granted[-1]]))
        else:
            device.during_step(inbox, P.NoMoreWork(round=0))

    report = run_async(_round(device, granted[:1], replies, rtt_s=0.001, sent=sent))
    assert check_accounting(granted, report.trained, report.returned) is None
    assert sorted(u.id for u in report.trained) == list(range(7))
    first = next(k for k, m in enumerate(sent) if isinstance(m, P.TrainProgress))
    # (before its first unit ended it knew no step time, and asked at each grant)
    assert not any(isinstance(m, P.AskForMoreWork) for m in sent[first:])
    assert sum(m.ask for m in sent if isinstance(m, P.TrainProgress)) >= 3, [
        (type(m).__name__[:5], getattr(m, "ask", None)) for m in sent
    ]


def test_units_of_a_few_milliseconds_report_together_and_a_grant_of_several_is_trained(worker) -> None:
    """Units shorter than `report_s` do not report one frame each: a report waits for the next
    (the ask's, or the barrier's) unless an ask is out, each unit in exactly one report, in the
    order trained. A grant of several units (AssignNext.units) is trained whole."""
    granted, sent = [_unit(0)], []

    def replies(n: int, inbox: asyncio.Queue) -> None:
        if n <= 3:
            more = [_unit(k) for k in range(len(granted), len(granted) + 3)]
            granted.extend(more)
            inbox.put_nowait(P.AssignNext(round=0, units=more))
        else:
            inbox.put_nowait(P.NoMoreWork(round=0))

    report = run_async(_round(worker, granted[:1], replies, rtt_s=0.001, report_s=60.0, sent=sent))
    assert check_accounting(granted, report.trained, report.returned) is None
    assert sorted(u.id for u in report.trained) == list(range(10))
    progress = [m for m in sent if isinstance(m, P.TrainProgress)]
    assert [u for m in progress + report.unsent for u in m.units] == report.trained  # each once, in order
    assert len(progress) <= len(report.trained) // 2, sent  # (one frame a unit without it)


def test_before_its_first_step_is_timed_a_node_asks_for_one_unit_ahead_not_more(worker) -> None:
    """A coordinator that answers at once, while the node's first step still runs: the node does
    not know its speed yet, so it holds one unit ahead of the one training and asks again only
    once a unit ended (no grabbing a queue's worth of units it may be too slow for)."""
    granted, device, sent = [_unit(0)], Slow(worker), []

    def replies(n: int, inbox: asyncio.Queue) -> None:
        if n <= 6:
            granted.append(_unit(n))
            inbox.put_nowait(P.AssignNext(round=0, units=[granted[-1]]))
        else:
            inbox.put_nowait(P.NoMoreWork(round=0))

    report = run_async(_round(device, granted[:1], replies, rtt_s=0.001, sent=sent))
    assert sorted(u.id for u in report.trained) == list(range(7))
    first = next(k for k, m in enumerate(sent) if isinstance(m, P.TrainProgress))
    assert [type(m) for m in sent[:first]] == [P.AskForMoreWork]


def test_a_late_reply_of_the_round_before_changes_nothing(worker) -> None:
    """Replies to the last round's asks that cross into this one (a grant, "no more work", a
    stop) are not this round's: no unit of the round before is trained, the round does not stop."""
    granted = [_unit(0)]

    def replies(n: int, inbox: asyncio.Queue) -> None:
        if n == 1:
            inbox.put_nowait(P.AssignNext(round=0, units=[_unit(9)]))
            inbox.put_nowait(P.StopRound(round=0))
            inbox.put_nowait(P.NoMoreWork(round=0))
        if n <= 2:
            granted.append(_unit(n))
            _later(inbox, P.AssignNext(round=1, units=[granted[-1]]), 0.01)
        else:
            _later(inbox, P.NoMoreWork(round=1), 0.01)

    report = run_async(_round(worker, granted[:1], replies, rnd=1))
    assert check_accounting(granted, report.trained, report.returned) is None
    assert report.returned == [] and sorted(u.id for u in report.trained) == [0, 1, 2]


class Loop:
    """`drift join`'s loop (drift.loop.run_join) in a thread of its own: it trains each batch the
    node hands out, and runs `at_step(k)` during its k-th step."""

    def __init__(self, worker, at_step=lambda k: None) -> None:
        self.steps, self.worker, self.at_step = Steps(), worker, at_step
        self.done = 0  # steps trained
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _run(self) -> None:
        for indices in self.steps.serve():
            self.at_step(self.done)
            self.steps.stepped(self.worker.train_step(indices, self.steps.parts))
            self.done += 1

    def close(self) -> None:
        self.steps.end()
        self.thread.join(60)


def test_units_train_while_the_node_is_busy(worker) -> None:
    """The node hands the thread that trains the units in hand at once: their steps run back to
    back, across units, while the node's own loop is busy (here: stuck in sending its ask until
    both units are trained), instead of each step or unit waiting for a round trip between the
    two threads."""
    loop = Loop(worker)
    trained_while_busy = []

    def replies(n: int, inbox: asyncio.Queue) -> None:  # blocks the node's loop
        trained_while_busy.append(wait_until(lambda: loop.done == 8))
        inbox.put_nowait(P.NoMoreWork(round=0))

    units = [_unit(0, 4), _unit(1, 4)]
    try:
        report = run_async(_round(OnLoop(worker, loop.steps), units, replies, unit_steps=4))
    finally:
        loop.close()
    assert trained_while_busy == [True]
    assert report.steps == 8 and report.trained == units and report.returned == []


def test_who_wants_the_model_gets_it_at_the_next_step(worker) -> None:
    """Someone who needs the model while a unit trains (the overlapped sync's catch-up, an
    evaluation) takes the worker's lock: the unit pauses at the next inner step for it, then the
    rest of the unit trains, and the unit is reported once, whole."""
    seen: list[int] = []
    waiting = threading.Event()

    async def take_the_model(inner: InnerLoop) -> None:
        got = asyncio.ensure_future(inner.lock.acquire())
        await asyncio.sleep(0)  # it asked for the lock (the unit is told to pause)
        waiting.set()
        await got
        seen.append(loop.done)
        inner.lock.release()

    def at_step(k: int) -> None:
        if k == 2:  # during the third step, someone asks for the model
            asyncio.run_coroutine_threadsafe(take_the_model(inner), node_loop)
            assert waiting.wait(60)

    loop = Loop(worker, at_step)
    recipe = Recipe(name="t", task="t.py", min_nodes=1, rounds=1, inner_steps=8, batch_size=BATCH, unit_steps=8)
    progress: list[P.TrainProgress] = []

    async def main():
        nonlocal inner, node_loop
        node_loop, inbox = asyncio.get_running_loop(), asyncio.Queue()

        async def send(msg: P._Msg) -> None:
            if isinstance(msg, P.AskForMoreWork):
                inbox.put_nowait(P.NoMoreWork(round=0))
            elif isinstance(msg, P.TrainProgress):
                progress.append(msg)

        inner = InnerLoop(OnLoop(worker, loop.steps), recipe, inbox, send)
        return await inner.run_round(P.ShardAssignment(round=0, epoch=0, units=[_unit(0, 8)]))

    inner = node_loop = None
    try:
        report = run_async(main())
    finally:
        loop.close()
    assert seen == [3]  # the step in flight finished, the next one waited
    assert report.steps == 8 and report.trained == [_unit(0, 8)] and report.returned == []
    # (reported once, whole: the round ended with it, so its report waits for the barrier's)
    assert [(p.units, p.steps) for p in progress + report.unsent] == [([_unit(0, 8)], 8)]


def test_who_queued_behind_the_unit_gets_the_model_before_its_steps(worker) -> None:
    """The overlapped sync takes the model twice in a row (Δ for the all-reduce, then the
    catch-up after the outer step): the second asks while the first holds the model and the unit
    already waits for it. It must not wait out the whole unit: then the round's outer step lands
    only at the next barrier, and a late joiner, always a round behind, never trains. The unit,
    once it has the model, steps aside for whoever was waiting already, then trains whole."""
    loop = Loop(worker)
    recipe = Recipe(name="t", task="t.py", min_nodes=1, rounds=1, inner_steps=8, batch_size=BATCH, unit_steps=8)
    seen: list[int] = []

    async def main():
        inbox: asyncio.Queue = asyncio.Queue()

        async def send(msg: P._Msg) -> None:
            if isinstance(msg, P.AskForMoreWork):
                inbox.put_nowait(P.NoMoreWork(round=0))

        inner = InnerLoop(OnLoop(worker, loop.steps), recipe, inbox, send)
        await inner.lock.acquire()  # the all-reduce's Δ
        rnd = asyncio.ensure_future(inner.run_round(P.ShardAssignment(round=0, epoch=0, units=[_unit(0, 8)])))
        await asyncio.sleep(0)  # the unit waits for the model
        catch_up = asyncio.ensure_future(inner.lock.acquire())
        await asyncio.sleep(0)  # ... and the catch-up behind it
        inner.lock.release()
        await catch_up
        seen.append(loop.done)
        inner.lock.release()
        return await rnd

    try:
        report = run_async(main())
    finally:
        loop.close()
    assert seen == [0]  # not after the unit's 8 steps
    assert report.steps == 8 and report.trained == [_unit(0, 8)] and report.returned == []


def wait_until(cond, limit_s: float = 60.0) -> bool:
    """cond() became true within limit_s (a bound on a hang, not a speed)."""
    done = threading.Event()
    for _ in range(int(limit_s / 0.01)):
        if cond():
            return True
        done.wait(0.01)
    return cond()
