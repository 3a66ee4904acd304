"""`drift join`, started ahead of time: torch is imported first, and the node connects only once
the file named by $DRIFT_TEST_GO exists. A late-join test then depends on the moment it chooses,
not on how long a fresh Python process takes to start on this machine."""

import os
import sys
import time
from pathlib import Path

import sim_node  # noqa: F401 - a simulated device when $DRIFT_SIM_STEP is set
import torch  # noqa: F401 - the slow part of a node's start-up, paid before the go

from drift.cli import main

go = Path(os.environ["DRIFT_TEST_GO"])
while not go.exists():
    time.sleep(0.02)
sys.exit(main(sys.argv[1:], prog_name="drift"))
