"""`drift coord` that asks for its first checkpoint late: only once a newer round than the one due
is agreed, as a busy coordinator, or a round that settled late after a retry, would. By then
every holder serves the newer round. Everything else is the real `drift coord`."""

import asyncio
import sys

from drift.cli import main
from drift.coordinator import Coordinator

checkpoint = Coordinator.checkpoint
delayed: list[int] = []


async def late_once(self, rnd, meta, *args, **kwargs):
    if not delayed:
        delayed.append(rnd)
        while self.swarm.newest() <= rnd:
            await asyncio.sleep(0.02)
    return await checkpoint(self, rnd, meta, *args, **kwargs)


Coordinator.checkpoint = late_once
sys.exit(main(sys.argv[1:], prog_name="drift"))
