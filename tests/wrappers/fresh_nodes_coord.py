"""`drift coord` as it runs on macOS and Windows: each `--local` node a fresh `python -m drift join`
process, not forked from one that imported torch (drift/forks.py forks on Linux only).
Everything else is the real `drift coord`."""

import sys

from drift import forks
from drift.cli import main

forks.available = lambda: False
sys.exit(main(sys.argv[1:], prog_name="drift"))
