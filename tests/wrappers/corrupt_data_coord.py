"""`drift coord` whose data holder flips one byte of the first samples it sends (a chunk corrupted
in flight, or a holder that lies once).
Everything else, the later replies included, is the real `drift coord`."""

import sys

import numpy as np

from drift.cli import main
from drift.data import DataServer

send = DataServer._send_bytes
flipped: list[int] = []


async def corrupt_once(self, ch, rows) -> None:
    if isinstance(rows, np.ndarray) and not flipped and rows.size:  # samples, not the manifest
        flipped.append(rows.shape[0])
        rows = rows.copy()
        rows[rows.shape[0] // 2, 0] ^= 0x5A
    await send(self, ch, rows)


DataServer._send_bytes = corrupt_once
sys.exit(main(sys.argv[1:], prog_name="drift"))
