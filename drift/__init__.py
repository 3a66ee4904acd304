"""drift: low-communication (DiLoCo-style) training across the machines you have, peer to peer.

`drift.DiLoCo(model, optimizer, ticket=..., samples=N)` puts your own training loop in a swarm
(drift/loop.py); the `drift` command runs coordinators and task-file nodes (drift/cli.py)."""

from drift.imports import isolate_main, own_packages

own_packages("auth", "workers")  # drift's own, before a user's script's directory can shadow them
isolate_main()  # a user's script next to its own `workers/` gets that one (see drift/imports.py)

__all__ = ["DiLoCo"]


def __getattr__(name: str):
    if name == "DiLoCo":  # imported on use: `python -m drift` needs none of it
        from drift.loop import DiLoCo

        return DiLoCo
    raise AttributeError(f"module 'drift' has no attribute {name!r}")
