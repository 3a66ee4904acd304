"""drift: low-communication (DiLoCo-style) training across the machines you have, peer to peer."""

from drift.imports import isolate_main, own_packages

own_packages("auth", "workers")  # drift's own, before a user's script's directory can shadow them
isolate_main()  # a user's script next to its own `workers/` gets that one (see drift/imports.py)
