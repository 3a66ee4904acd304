"""A node's share of a round (drift/inner.py) when control messages cross each other, as they do
all the time on fast devices: the test plays the coordinator's side of the protocol and delivers
its replies in exactly the orders that steps of a millisecond produce. The node must account for
every granted sample exactly once (trained, or returned), or the coordinator throws away its
whole round as a bad report."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest
from conftest import run_async

from drift import protocol as P
from drift.inner import InnerLoop
from drift.recipe import Recipe
from drift.scheduler import check_accounting
from drift.workers import load_task, make_worker

TASK = Path(__file__).parent / "tasks" / "points_mlp.py"
BATCH = 16


@pytest.fixture(scope="module")
def worker():
    return make_worker(load_task(TASK), {"hidden": 8}, {"lr": 0.01}, backend="torch", device="cpu", threads=1)


def _unit(uid: int) -> P.WorkUnit:
    return P.WorkUnit(id=uid, lo=0, hi=2 * BATCH)


async def _round(worker, first: list[P.WorkUnit], replies) -> tuple[list[P.WorkUnit], object]:
    """Run one round; `replies(ask_count, inbox)` is the coordinator's answer to each AskForMoreWork."""
    recipe = Recipe(name="t", task="t.py", min_nodes=1, rounds=1, inner_steps=4, batch_size=BATCH, unit_steps=2)
    inbox: asyncio.Queue = asyncio.Queue()
    asks = 0

    async def send(msg: P._Msg) -> None:
        nonlocal asks
        if isinstance(msg, P.AskForMoreWork):
            asks += 1
            replies(asks, inbox)

    inner = InnerLoop(worker, recipe, inbox, send)
    inner.rtt_s = 60.0  # a slow link next to a fast device: the node asks ahead at every step
    report = await inner.run_round(P.ShardAssignment(round=0, epoch=0, units=first))
    return report


def _later(inbox: asyncio.Queue, msg: P._Msg, delay: float = 0.05) -> None:
    asyncio.get_running_loop().call_later(delay, inbox.put_nowait, msg)


def test_stop_round_that_crosses_a_grant(worker) -> None:
    """StopRound arrives while the node waits for the answer to its ask, and the answer is one
    more unit: that unit and the ones in hand are handed back once each."""
    granted = [_unit(0), _unit(1)]

    def replies(n: int, inbox: asyncio.Queue) -> None:
        inbox.put_nowait(P.StopRound(round=0))
        granted.append(_unit(2 + n))
        _later(inbox, P.AssignNext(round=0, unit=granted[-1]))

    report = run_async(_round(worker, granted[:2], replies))
    assert check_accounting(granted, report.trained, report.returned) is None, (report.trained, report.returned)
    assert report.trained and report.samples == sum(u.hi - u.lo for u in report.trained)


def test_stop_round_that_crosses_no_more_work(worker) -> None:
    granted = [_unit(0), _unit(1)]

    def replies(n: int, inbox: asyncio.Queue) -> None:
        inbox.put_nowait(P.StopRound(round=0))
        _later(inbox, P.NoMoreWork(round=0))

    report = run_async(_round(worker, granted, replies))
    assert check_accounting(granted, report.trained, report.returned) is None, (report.trained, report.returned)


def test_grants_until_no_more_work_train_everything(worker) -> None:
    """No StopRound: every unit granted, in hand or in flight, is trained, none twice."""
    granted = [_unit(0)]

    def replies(n: int, inbox: asyncio.Queue) -> None:
        if n <= 3:
            granted.append(_unit(n))
            _later(inbox, P.AssignNext(round=0, unit=granted[-1]), 0.01)
        else:
            _later(inbox, P.NoMoreWork(round=0), 0.01)

    report = run_async(_round(worker, granted[:1], replies))
    assert check_accounting(granted, report.trained, report.returned) is None
    assert report.returned == [] and sorted(u.id for u in report.trained) == [0, 1, 2, 3]
