"""drift: low-communication (DiLoCo-style) training across the machines you have, peer to peer.

`drift.DiLoCo(model, optimizer, ticket=..., samples=N)` puts your own training loop in a swarm
(drift/loop.py); the `drift` command runs coordinators and task-file nodes (drift/cli.py).
drift's device backends and identity live in `drift.workers` and `drift.auth` (the repository's
`workers/` and `auth/` folders), so a project's own `workers` or `auth` never clashes with them."""

__all__ = ["DiLoCo"]


def __getattr__(name: str):
    if name == "DiLoCo":  # imported on use: `python -m drift` needs none of it
        from drift.loop import DiLoCo

        return DiLoCo
    raise AttributeError(f"module 'drift' has no attribute {name!r}")
