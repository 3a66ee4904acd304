"""`drift coord` that hangs up on the first handshake without a word, as if that node's first
frame had arrived garbled (seen once in CI): it reads the NodeInfo, writes the node's name to
$DRIFT_TEST_CUT and drops the connection. Every later connection, and everything else, is the real
`drift coord`."""

import os
import sys
from pathlib import Path

from drift import protocol as P
from drift.cli import main
from drift.coordinator import Coordinator
from drift.transport import MAX_CONTROL_FRAME, Endpoint

serve = Coordinator._serve
cut: list[str] = []


def note(name: str) -> None:
    Path(os.environ["DRIFT_TEST_CUT"]).write_text(name)


async def garbled_once(self, conn) -> None:
    if cut:
        return await serve(self, conn)
    cut.append("?")
    ch = await Endpoint.accept_channel(conn)
    note(P.decode(await ch.recv_frame(MAX_CONTROL_FRAME)).name)
    self._drop(ch, conn, "frame is not JSON (garbled on the way, in this test)")


Coordinator._serve = garbled_once
sys.exit(main(sys.argv[1:], prog_name="drift"))
