"""The `drift` command: `drift coord RECIPE [--local N]` and `drift join --repo R --ticket T`.

User mistakes end in one line on stderr (`drift: error: ...`) and a non-zero exit, never a
traceback; set DRIFT_DEBUG=1 to see the traceback anyway.
"""

from __future__ import annotations

import asyncio
import logging
import os
import subprocess
import sys
import time
from pathlib import Path

import click

from drift.coordinator import Coordinator, CoordinatorError
from drift.monitor import Monitor
from drift.node import NodeError, NodeOptions, run_node
from drift.recipe import RecipeError, load_recipe, repo_root
from drift.ring import RingError
from drift.transport import TransportError

USER_ERRORS = (RecipeError, TransportError, CoordinatorError, NodeError, RingError)


def _fail(msg: str, code: int = 1) -> None:
    click.echo(f"drift: error: {msg}", err=True)
    sys.exit(code)


def _run(coro) -> int:  # noqa: ANN001
    try:
        return asyncio.run(coro)
    except USER_ERRORS as e:
        if os.environ.get("DRIFT_DEBUG"):
            raise
        _fail(str(e))
    except KeyboardInterrupt:
        _fail("interrupted", 130)
    return 1


@click.group()
@click.option("-v", "--verbose", is_flag=True, help="Debug logging.")
def main(verbose: bool) -> None:
    """drift: train one model across the machines you have, peer to peer."""
    logging.basicConfig(level=logging.DEBUG if verbose else logging.WARNING,
                        format="%(asctime)s %(name)s %(levelname)s %(message)s")


def _git_head(root: Path) -> str | None:
    out = subprocess.run(["git", "-C", str(root), "rev-parse", "HEAD"], capture_output=True, text=True)
    return out.stdout.strip() if out.returncode == 0 else None


@main.command()
@click.argument("recipe", type=click.Path(path_type=Path))
@click.option("--local", "local", type=click.IntRange(min=0), default=0, show_default=True,
              help="Also start N nodes on this machine (real processes).")
@click.option("--run-dir", type=click.Path(path_type=Path), default=None,
              help="Where metrics.jsonl and logs go [default: runs/NAME-TIME].")
@click.option("--network", type=click.Choice(["local", "lan", "relay"]), default=None,
              help="local: loopback only; lan: this machine's addresses; relay: iroh relays + "
                   "hole-punching [default: the recipe's].")
@click.option("--threads", type=click.IntRange(min=1), default=None,
              help="Torch threads per --local node [default: cores / N].")
def coord(recipe: Path, local: int, run_dir: Path | None, network: str | None, threads: int | None) -> None:
    """Coordinate a run: print a join ticket, admit nodes, run the rounds."""
    try:
        r = load_recipe(recipe)
    except RecipeError as e:
        _fail(str(e))
    root = repo_root(recipe)
    run_dir = run_dir or Path("runs") / f"{r.name}-{time.strftime('%Y%m%d-%H%M%S')}"
    mode = network or r.network
    if local and mode == "relay":
        mode = "local" if network is None else mode
    sys.exit(_run(_coord(r, root, run_dir, mode, local, threads)))


async def _coord(r, root: Path, run_dir: Path, mode: str, local: int, threads: int | None) -> int:  # noqa: ANN001
    monitor = Monitor(run_dir)
    coordinator = Coordinator(r, run_dir, mode=mode, commit=r.commit or _git_head(root), monitor=monitor)
    children: list[tuple[subprocess.Popen, Path]] = []
    try:
        ticket = await coordinator.start()
        monitor.say(f"run {coordinator.run_id}: {r.name}, {r.rounds} rounds, waiting for {r.min_nodes} node(s)")
        monitor.say(f"join with:  drift join --repo {root} --ticket {ticket}")
        monitor.say(f"run dir:    {run_dir}")
        if local:
            per_node = threads or max(1, (os.cpu_count() or 1) // local)
            for i in range(local):
                logf = run_dir / f"node-{i}.log"
                cmd = [sys.executable, "-m", "drift", "join", "--repo", str(root), "--ticket", ticket,
                       "--name", f"local-{i}", "--threads", str(per_node)]
                with open(logf, "w") as fh:
                    children.append((subprocess.Popen(cmd, stdout=fh, stderr=subprocess.STDOUT,
                                                      env={**os.environ, "PYTHONUNBUFFERED": "1"}), logf))
        run = asyncio.ensure_future(coordinator.run())
        watch = asyncio.ensure_future(_watch_children(children))
        done, _ = await asyncio.wait({run, watch}, return_when=asyncio.FIRST_COMPLETED)
        if run not in done:
            run.cancel()
            watch.result()  # raises the child's failure
        watch.cancel()
        results = run.result()
        for proc, logf in children:
            try:
                await asyncio.wait_for(asyncio.to_thread(proc.wait), 30)
            except asyncio.TimeoutError:
                proc.kill()
            if proc.returncode:
                raise CoordinatorError(f"local node exited with code {proc.returncode}; see {logf}")
        first = coordinator.initial_val_loss or results[0].val_loss
        monitor.say(f"done: {len(results)} rounds, val loss {first:.4f} -> {results[-1].val_loss:.4f}; "
                    f"metrics in {run_dir / 'metrics.jsonl'}")
        return 0
    finally:
        for proc, _ in children:
            if proc.poll() is None:
                proc.terminate()
        await coordinator.close()
        monitor.close()


async def _watch_children(children: list[tuple[subprocess.Popen, Path]]) -> None:
    """Fail the run when a --local node dies, quoting the last line of its log."""
    while True:
        for proc, logf in children:
            if proc.poll() not in (None, 0):
                lines = logf.read_text(errors="replace").strip().splitlines()
                raise CoordinatorError(f"local node exited with code {proc.returncode}: "
                                       f"{lines[-1] if lines else '(no output)'} (log: {logf})")
        await asyncio.sleep(0.5)


@main.command()
@click.option("--repo", required=True, type=click.Path(path_type=Path),
              help="The repo holding the task code (a local checkout for now).")
@click.option("--ticket", required=True, help="The ticket `drift coord` printed.")
@click.option("--name", default=None, help="A name for this node in the coordinator's view.")
@click.option("--device", default="auto", show_default=True, help="auto, cpu, cuda, cuda:N, mps.")
@click.option("--threads", type=click.IntRange(min=1), default=None, help="Torch CPU threads.")
def join(repo: Path, ticket: str, name: str | None, device: str, threads: int | None) -> None:
    """Join a swarm: load the task from REPO, train, sync, until the run completes."""
    if not repo.is_dir():
        _fail(f"--repo {repo}: no such directory")
    opts = NodeOptions(ticket=ticket, repo=repo.resolve(), device=device, threads=threads)
    if name:
        opts.name = name
    sys.exit(_run(run_node(opts)))
