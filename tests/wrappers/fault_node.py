"""`drift join` with one injected fault, for tests that must hit an exact moment whatever the
speed of the machine. $DRIFT_TEST_FAULT names it; the process stops itself (SIGSTOP, as a closed
laptop lid or a debugger would), and the test then kills or continues it:
  * stop-in-allreduce:R    right after sending its first ring chunk of round R (the all-reduce
                           cannot finish without it);
  * stop-after-progress:R  right after reporting its first finished unit of round R (mid-round).
"""

import os
import signal
import sys

from drift import protocol as P
from drift.cli import main
from drift.node import Session
from drift.ring import Ring

kind, _, arg = os.environ["DRIFT_TEST_FAULT"].partition(":")
at_round = int(arg)


def _stop() -> None:
    os.kill(os.getpid(), signal.SIGSTOP)


if kind == "stop-in-allreduce":
    _send_chunk = Ring._send_chunk

    async def _send_chunk_then_stop(self, ch, payload, codec, round_, *rest) -> None:  # noqa: ANN001
        await _send_chunk(self, ch, payload, codec, round_, *rest)
        if round_ == at_round:
            _stop()

    Ring._send_chunk = _send_chunk_then_stop
elif kind == "stop-after-progress":
    _send = Session.send

    async def _send_then_stop(self, msg) -> None:  # noqa: ANN001
        await _send(self, msg)
        if isinstance(msg, P.TrainProgress) and msg.round == at_round:
            _stop()

    Session.send = _send_then_stop
else:
    raise SystemExit(f"unknown DRIFT_TEST_FAULT {kind!r}")
sys.exit(main(sys.argv[1:], prog_name="drift"))
