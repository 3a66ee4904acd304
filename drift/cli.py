"""The `drift` command: `drift coord RECIPE [--local N]` and `drift join --repo R --ticket T`.

User mistakes end in one line on stderr (`drift: error: ...`) and a non-zero exit, never a
traceback; set DRIFT_DEBUG=1 to see the traceback anyway.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import click

from drift import forks
from drift.auth import AuthError, KeyLock, NodeKey, default_key_path, load_or_create_key
from drift.coordinator import Coordinator, CoordinatorError
from drift.dashboard import Dashboard, DashboardError, parse_addr
from drift.inner import Steps
from drift.monitor import Monitor, RunDirError
from drift.node import NodeError, NodeOptions
from drift.recipe import RecipeError, load_recipe, repo_root
from drift.repo import RepoCache, RepoError, dirty_files, is_commit_id, resolve_commit, tree_of
from drift.ring import RingError
from drift.transport import TransportError, mark_finished, parse_ticket, ticket_run
from drift.wandb_log import WandbError, WandbLog

USER_ERRORS = (
    RecipeError,
    TransportError,
    CoordinatorError,
    NodeError,
    RingError,
    AuthError,
    RepoError,
    DashboardError,
    WandbError,
    RunDirError,
)


def _fail(msg: str, code: int = 1) -> None:
    """One `drift: error:` line per problem (a recipe may hold several), then exit."""
    for line in msg.splitlines() or [msg]:
        click.echo(f"drift: error: {line}", err=True)
    sys.exit(code)


LocalNode = subprocess.Popen | forks.Forked  # a --local node's process: fresh, or forked (drift/forks.py)


def _absolute(path: Path | None) -> Path | None:
    """Every path the CLI takes is made absolute once, here at the edge: later code (git worktrees
    inside a mirror, child processes, checkpoints) may run in another working directory."""
    return None if path is None else path.expanduser().resolve()


def _run(coro) -> int:
    return _run_sync(asyncio.run, coro)


def _run_sync(fn, *args) -> int:
    """fn(*args) with user errors as one line (a node runs its own event loop: drift.loop)."""
    try:
        return fn(*args)
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
    logging.basicConfig(
        level=logging.DEBUG if verbose else logging.WARNING, format="%(asctime)s %(name)s %(levelname)s %(message)s"
    )


def _git_head(root: Path) -> str | None:
    try:
        return resolve_commit(root, "HEAD")
    except RepoError:
        return None


def _key(path: Path | None, kind: str, device: str | None = None):
    """Load (or create on first use) a key file; a bad one ends in one error line."""
    try:
        return load_or_create_key(_absolute(path) or default_key_path(kind, device))
    except AuthError as e:
        _fail(str(e))


@main.command("id")
@click.option(
    "--key",
    type=click.Path(path_type=Path),
    default=None,
    help="Key file [default: ~/.drift/node.key, or ~/.drift/coord.key with --coord; $DRIFT_HOME replaces ~/.drift].",
)
@click.option("--coord", is_flag=True, help="Print the coordinator's id instead of the node's.")
@click.option("--device", default=None, help="The id of the node that runs with --device DEVICE (its own key).")
def id_(key: Path | None, coord: bool, device: str | None) -> None:
    """Print this machine's node id (its Ed25519 public key), creating the key on first use."""
    click.echo(_key(key, "coord" if coord else "node", None if coord else device).node_id)


@main.command()
@click.argument("recipe", type=click.Path(path_type=Path))
@click.option(
    "--local",
    "local",
    type=click.IntRange(min=0),
    default=0,
    show_default=True,
    help="Also start N nodes on this machine (real processes).",
)
@click.option(
    "--run-dir",
    type=click.Path(path_type=Path),
    default=None,
    help="Where metrics.jsonl and logs go [default: runs/NAME-TIME].",
)
@click.option(
    "--network",
    type=click.Choice(["auto", "local", "lan", "relay"]),
    default=None,
    help="auto: this machine's addresses, plus iroh's relays when one answers; local: loopback "
    "only; lan: this machine's addresses; relay: relays required [default: the recipe's; "
    "local with --local unless the recipe says lan].",
)
@click.option(
    "--threads", type=click.IntRange(min=1), default=None, help="Torch threads per --local node [default: cores / N]."
)
@click.option(
    "--key",
    type=click.Path(path_type=Path),
    default=None,
    help="The coordinator's key file, kept across runs [default: a fresh key each run, so an old ticket admits to nothing].",
)
@click.option(
    "--keep-key",
    is_flag=True,
    help="Use ~/.drift/coord.key (created on first use) for every run: the coordinator's id stays the same "
    "(`drift id --coord`); an earlier run's ticket is still refused.",
)
@click.option(
    "--min-nodes",
    type=click.IntRange(min=1),
    default=None,
    help="Start with this many nodes, not the recipe's min_nodes (round_samples stays the recipe's; "
    "--min-nodes 1 --local 1: a swarm of one, for debugging).",
)
@click.option(
    "--resume",
    is_flag=True,
    help="Continue from the newest checkpoint that verifies (in --run-dir, else the newest runs/NAME-*).",
)
@click.option(
    "--dashboard",
    "dashboard",
    default="127.0.0.1",
    show_default=True,
    metavar="HOST[:PORT]|off",
    help="Serve the run's live page there (read-only; the printed URL carries its token; no PORT: a free one). "
    "off: no page.",
)
def coord(
    recipe: Path,
    local: int,
    run_dir: Path | None,
    network: str | None,
    threads: int | None,
    key: Path | None,
    keep_key: bool,
    min_nodes: int | None,
    resume: bool,
    dashboard: str,
) -> None:
    """Coordinate a run: print a join ticket, admit nodes, run the rounds."""
    try:
        page_addr = parse_addr(dashboard)
    except DashboardError as e:
        _fail(str(e))
    recipe, run_dir = _absolute(recipe), _absolute(run_dir)
    try:
        r = load_recipe(recipe)
    except RecipeError as e:
        _fail(str(e))
    if min_nodes is not None:
        r = r.model_copy(update={"min_nodes": min_nodes})  # round_samples was set from the recipe's
    root = repo_root(recipe)
    checkpoint = None
    if resume:
        run_dir, checkpoint = _find_checkpoint(r.name, run_dir)
        r = _resumed_recipe(r, recipe, checkpoint)
    run_dir = run_dir or Path("runs").resolve() / f"{r.name}-{time.strftime('%Y%m%d-%H%M%S')}"
    mode = network or r.network
    if local and network is None and mode in ("auto", "relay"):
        mode = "local"  # --local nodes are on this machine: loopback, nothing leaves it
    coord_key = _key(key, "coord") if key or keep_key else NodeKey.generate()
    try:
        pin = r.commit.lower() if r.commit and is_commit_id(r.commit.lower()) else None
        commit = pin or (resolve_commit(root, r.commit) if r.commit else _git_head(root))
    except RepoError as e:
        _fail(f"{recipe}: commit: {e}")
    if commit is None:
        _fail(
            f"{recipe}: {root} is not a git repository and the recipe pins no commit: nodes run only "
            f"committed code (git init && git commit there, or set commit:)"
        )
    sys.exit(_run(_coord(r, recipe, root, run_dir, mode, local, threads, coord_key, commit, checkpoint, page_addr)))


def _resumed_recipe(r, path: Path, checkpoint):
    """--resume: the recipe, keeping the checkpoint's round_samples unless the file sets its own
    (a run resumed with fewer nodes trains rounds of the same size), and a warning per field
    that differs from the checkpoint's recipe."""
    import yaml

    before = checkpoint.manifest.get("recipe")
    if not isinstance(before, dict):
        return r  # a checkpoint from an older drift: nothing to compare
    try:
        told = "round_samples" in (yaml.safe_load(path.read_text()) or {})
    except (OSError, yaml.YAMLError):
        told = True
    if not told and isinstance(before.get("round_samples"), int) and before["round_samples"] != r.round_samples:
        r = r.model_copy(update={"round_samples": before["round_samples"]})
    now = r.model_dump(mode="json", exclude={"wandb"})
    changed = [k for k in sorted(set(now) | set(before)) if now.get(k) != before.get(k)]
    for k in changed:
        click.echo(
            f"drift: warning: --resume: {k} is {now.get(k)!r}, the checkpoint's run had {before.get(k)!r}", err=True
        )
    return r


def is_script(task: Path) -> bool:
    """A task file defines a model factory (make_model, ...); a script that trains in its own loop
    (drift.DiLoCo, a trainer's DriftCallback) defines none."""
    import ast

    from drift.workers.base import MODEL_FACTORIES

    try:
        tree = ast.parse(task.read_text())
    except (OSError, SyntaxError, ValueError):
        return False  # the node says what is wrong with it
    names = {n.name for n in tree.body if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))}
    return not names & {f for fs in MODEL_FACTORIES.values() for f in fs}


def _find_checkpoint(name: str, run_dir: Path | None):
    """--resume: the newest checkpoint that verifies, in RUN_DIR or else the newest runs/NAME-* ."""
    from drift.checkpoint import latest_checkpoint

    if run_dir is None:
        runs = sorted(Path("runs").resolve().glob(f"{name}-*/checkpoints"), key=lambda p: p.stat().st_mtime)
        if not runs:
            _fail(f"--resume: no runs/{name}-*/checkpoints here; name the run with --run-dir")
        run_dir = runs[-1].parent
    ckpt, warnings = latest_checkpoint(run_dir / "checkpoints")
    for w in warnings:
        click.echo(f"drift: warning: {w}", err=True)
    if ckpt is None:
        _fail(f"--resume: no checkpoint that verifies in {run_dir / 'checkpoints'}")
    return run_dir, ckpt


async def _coord(
    r,
    recipe: Path,
    root: Path,
    run_dir: Path,
    mode: str,
    local: int,
    threads: int | None,
    coord_key,
    commit: str,
    checkpoint=None,
    page_addr: tuple[str, int] | None = None,
) -> int:
    monitor = Monitor(run_dir, round_samples=r.round_samples or 0)
    page = Dashboard() if page_addr else None
    board: WandbLog | None = None
    script = is_script(root / r.task)  # a user's own loop (drift.DiLoCo): --local runs it as `python SCRIPT TICKET`
    # (started now: its imports run while the coordinator starts)
    server = forks.Server() if local and forks.available() else None
    # a script's node takes its key from $DRIFT_HOME/node.key: one home a node
    node_keys = [
        load_or_create_key(run_dir / "keys" / (f"node-{i}/node.key" if script else f"node-{i}.key"))
        for i in range(local)
    ]
    coordinator = Coordinator(
        r,
        run_dir,
        mode=mode,
        commit=commit,
        monitor=monitor,
        key=coord_key.seed,
        tree=tree_of(root, commit) if commit else None,
        extra_allowed=tuple(k.node_id for k in node_keys),
        resume=checkpoint,
        repo=root,
    )
    children: list[tuple[LocalNode, Path]] = []
    # Ctrl-C is ours from before the first line the user can react to (a signal that came before
    # the handler once hung the process: asyncio.run's own handler cancelled mid-startup).
    stop = asyncio.Event()

    def on_signal() -> None:
        if stop.is_set():  # a second Ctrl-C: leave now, without waiting for anything
            click.echo("drift: interrupted again; exiting without a checkpoint", err=True)
            for proc, _ in children:
                proc.kill()
            os._exit(130)
        stop.set()

    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):  # Ctrl-C: checkpoint, tell the nodes, exit
        loop.add_signal_handler(sig, on_signal)
    run: asyncio.Task | None = None
    try:
        ticket = await coordinator.start()
        join = f"drift join --repo {root} --ticket {ticket}"
        if page is not None:
            url = await page.start(*page_addr)
            monitor.subscribers.append(page.event)
        if r.wandb is not None:
            board = WandbLog.open(r, coordinator.run_id, run_dir)
            monitor.subscribers.append(board.event)
        monitor.event(
            "run",
            run_id=coordinator.run_id,
            recipe=r.name,
            rounds=r.rounds,
            round_samples=r.round_samples,
            min_nodes=r.min_nodes,
            sync=r.sync,
            codec=r.codec,
            commit=commit,
            resumed_after=checkpoint.round if checkpoint is not None else None,
        )
        monitor.say(f"run {coordinator.run_id}: {r.name}, {r.rounds} rounds, waiting for {r.min_nodes} node(s)")
        monitor.say(f"join with:  {join}")
        monitor.say(f"run dir:    {run_dir}")
        _say_reach(monitor, coordinator.endpoint, mode, local)
        if page is not None:
            monitor.say(f"dashboard:  {url}")
        if checkpoint is not None:
            monitor.say(f"resuming:   after round {checkpoint.round} ({checkpoint.path})")
        monitor.say(f"commit:     {commit} (coordinator {coordinator.endpoint.node_id[:10]})")
        if commit == _git_head(root) and _dirty(root):
            monitor.say(f"note: {root} has uncommitted changes; nodes run commit {commit[:12]} as committed")
        needed = max(r.min_nodes, r.auth_threshold or 0)
        if local and local < needed:
            monitor.say(
                f"note: {recipe.name} needs {needed} nodes (min_nodes) and --local starts {local}: "
                f"the run waits for {needed - local} more; start each with the join command above "
                f"(or use --local {needed})"
            )
        if local and not stop.is_set():
            per_node = threads or max(1, (os.cpu_count() or 1) // local)
            for i in range(local):
                logf = run_dir / f"node-{i}.log"
                args = [
                    "join",
                    "--repo",
                    str(root),
                    "--name",
                    f"local-{i}",
                    "--threads",
                    str(per_node),
                    "--key",
                    str(node_keys[i].path),
                    "--cache-dir",
                    str(run_dir / "repos"),
                ]
                title, task, cwd = f"drift join --name local-{i}", None, None
                # The ticket goes in the environment: a command line is readable by any user in ps.
                env = {
                    **os.environ,
                    "PYTHONUNBUFFERED": "1",
                    "DRIFT_PARENT_PID": str(os.getpid()),
                    "DRIFT_TICKET": ticket,
                }
                if script:  # the script as a user runs it, in a clean checkout of the commit
                    try:
                        cwd = RepoCache(root, run_dir / "repos").checkout(commit)
                    except RepoError as e:
                        monitor.say(f"drift: error: --local: {e}")
                        stop.set()
                        break
                    task, args = cwd / r.task, [ticket]  # (forked, its title in ps has no ticket)
                    title = f"python {r.task} (drift --local node {i})"
                    env.update(DRIFT_HOME=str(node_keys[i].path.parent))
                # Their own session: a terminal's Ctrl-C goes to the whole foreground process group,
                # and the nodes must outlive the coordinator's first moments of it to hand over θ
                # for the last checkpoint. They leave when told, or when this process is gone.
                if server is not None:
                    node_threads = None if script else per_node  # (a script's torch threads are its own)
                    try:
                        forked = await asyncio.to_thread(server.fork, args, env, logf, title, node_threads, task, cwd)
                    except OSError as e:
                        monitor.say(f"drift: error: --local: {e}")
                        stop.set()
                        break
                    children.append((forked, logf))
                    continue
                cmd = [sys.executable, *([str(task)] if task else ["-m", "drift"]), *args]
                with open(logf, "w") as fh:
                    popen = subprocess.Popen(
                        cmd, stdout=fh, stderr=subprocess.STDOUT, start_new_session=True, cwd=cwd, env=env
                    )
                children.append((popen, logf))
        run = asyncio.ensure_future(coordinator.run())
        watch = asyncio.ensure_future(_watch_children(children, node_keys, coordinator, monitor))
        stopper = asyncio.ensure_future(stop.wait())
        failed = asyncio.ensure_future(monitor.failed.wait())
        done, _ = await asyncio.wait({run, watch, stopper, failed}, return_when=asyncio.FIRST_COMPLETED)
        failed.cancel()
        if failed in done and stopper not in done:  # a full disk, a read-only mount: stop as on Ctrl-C
            run.cancel()
            watch.cancel()
            kept = await coordinator.interrupt(f"the coordinator stopped: {monitor.error}")
            await _wait_children(children, 10.0)
            raise CoordinatorError(f"{monitor.error}; stopped the run ({kept})")
        if stopper in done:
            monitor.say("stopping: keeping the newest finished round and telling the nodes (Ctrl-C again: quit now)")
            run.cancel()
            watch.cancel()
            kept = await coordinator.interrupt("the coordinator was stopped; it can resume with --resume")
            monitor.say(f"interrupted: {kept}")
            monitor.say(f"resume with: drift coord {recipe} --resume --run-dir {run_dir}")
            _keep_page(monitor, run_dir)
            await _wait_children(children, 10.0)
            return 130
        stopper.cancel()
        if run not in done:  # every local node died: keep the newest finished round, as Ctrl-C does
            run.cancel()
            try:
                watch.result()
            except CoordinatorError as e:
                rnd = coordinator.current.rnd if coordinator.current is not None else -1
                for (proc, _), k in zip(children, node_keys):  # never asked for θ (Swarm.donors)
                    if proc.poll() not in (None, 0):
                        coordinator.drop(k.node_id, f"its process {_exit(proc.returncode)}", rnd)
                kept = await coordinator.interrupt(f"the coordinator stopped: {e}")
                monitor.say(f"resume with: drift coord {recipe} --resume --run-dir {run_dir}")
                await _wait_children(children, 10.0)
                raise CoordinatorError(f"{e}; stopped the run ({kept})") from None
        watch.cancel()
        results = run.result()
        for i, (proc, logf) in enumerate(children):
            if await _wait_children([(proc, logf)], 30.0) and proc.returncode:
                raise CoordinatorError(f"local node local-{i} {_exit(proc.returncode)}; see {logf}")
        first = coordinator.initial_val_loss
        first = first if first is not None else results[0].val_loss
        vals = [f"{v:.4f}" if v is not None else "?" for v in (first, coordinator.final_val_loss)]
        monitor.say(
            f"done: {len(results)} rounds, val loss {vals[0]} -> {vals[1]}; metrics in {run_dir / 'metrics.jsonl'}"
        )
        _keep_page(monitor, run_dir)
        return 0
    finally:
        if run is not None:
            run.cancel()
        for proc, _ in children:
            if proc.poll() is None:
                proc.terminate()
        await coordinator.close()
        if page is not None:
            await page.close()
        monitor.close()
        if board is not None:
            board.close()
        with contextlib.suppress(OSError):
            mark_finished(coordinator.run_id)


def _keep_page(monitor: Monitor, run_dir: Path) -> None:
    """The run's page as it ended, one static file in the run dir: the live URL ends with the
    coordinator (`drift report` writes it again, with the plots)."""
    from drift.dashboard import write_static
    from drift.monitor import read_events

    try:
        monitor.say(f"page:       {write_static(read_events(run_dir), run_dir / 'dashboard.html')}")
    except OSError as e:
        monitor.say(f"warning: the run's page was not written: {e}")


def _say_reach(monitor: Monitor, endpoint, mode: str, local: int) -> None:
    """One line on who can use the ticket, when it is less than "anyone online"."""
    if mode == "local" and not local:
        monitor.say("note: network local: the ticket works on this machine only (--network lan for others)")
    elif mode == "auto" and not endpoint.has_relay:
        addrs = ", ".join(endpoint.addresses()) or "none"
        monitor.say(f"note: no iroh relay reachable; the ticket carries this machine's addresses ({addrs})")


async def _wait_children(children: list[tuple[LocalNode, Path]], timeout: float) -> bool:
    """Wait for local nodes to exit (they were told why); kill what is left. True if all exited."""
    deadline = time.monotonic() + timeout
    while any(p.poll() is None for p, _ in children) and time.monotonic() < deadline:
        await asyncio.sleep(0.1)
    clean = True
    for proc, _ in children:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
            clean = False
    return clean


async def _watch_children(
    children: list[tuple[LocalNode, Path]],
    keys: list[NodeKey],
    coordinator: Coordinator,
    monitor: Monitor,
) -> None:
    """A --local node that dies leaves the run going: it is dropped at once (never asked for θ,
    its units back in the queue) and a line names it, its exit and its log's last line. When the
    last one dies, fail the run."""
    dead: set[int] = set()
    while True:
        for i, (proc, logf) in enumerate(children):
            if i in dead or proc.poll() in (None, 0):
                continue
            dead.add(i)
            lines = logf.read_text(errors="replace").strip().splitlines()
            what = (
                f"local node local-{i} {_exit(proc.returncode)}: {lines[-1] if lines else '(no output)'} (log: {logf})"
            )
            if len(dead) == len(children):
                raise CoordinatorError(what)
            rnd = coordinator.current.rnd if coordinator.current is not None else -1
            coordinator.drop(keys[i].node_id, f"its process {_exit(proc.returncode)}", rnd)
            monitor.say(f"warning: {what}; the run goes on with {len(children) - len(dead)} local node(s)")
        await asyncio.sleep(0.5)


def _exit(code: int) -> str:
    """How a process ended, as a user reads it: "exited with code 1", "exited with code -9 (SIGKILL)"."""
    try:
        return f"exited with code {code}" + (f" ({signal.Signals(-code).name})" if code < 0 else "")
    except ValueError:  # not a signal this platform names
        return f"exited with code {code}"


def _dirty(root: Path) -> bool:
    try:
        return bool(dirty_files(root))
    except Exception:
        return False


@main.command()
@click.option(
    "--repo",
    required=True,
    metavar="URL_OR_PATH",
    help="The git repo holding the task code (URL or path); drift clones it and runs "
    "exactly the commit the coordinator names, from a clean checkout.",
)
@click.option(
    "--ticket",
    required=True,
    envvar="DRIFT_TICKET",
    help="The ticket `drift coord` printed [or $DRIFT_TICKET, which keeps it out of `ps`].",
)
@click.option("--name", default=None, help="A name for this node in the coordinator's view.")
@click.option(
    "--backend", default="auto", show_default=True, help="The framework this node trains with: auto, torch, mlx, numpy."
)
@click.option(
    "--device",
    default="auto",
    show_default=True,
    help="auto, cpu, cuda, cuda:N, rocm, rocm:N, mps (torch on Apple), metal (mlx on Apple).",
)
@click.option(
    "--devices",
    default=None,
    metavar="LIST",
    help="Train this one node on several GPUs (cuda:0,cuda:1): DDP inside the node, one swarm member.",
)
@click.option(
    "--nproc", type=int, default=None, metavar="N", help="Train this one node with N CPU processes (DDP over gloo)."
)
@click.option("--threads", type=click.IntRange(min=1), default=None, help="Torch CPU threads (per process).")
@click.option(
    "--key",
    type=click.Path(path_type=Path),
    default=None,
    help="This node's key file [default: ~/.drift/node.key, or ~/.drift/node-DEVICE.key with "
    "--device]; created on first use.",
)
@click.option(
    "--cache-dir",
    type=click.Path(path_type=Path),
    default=None,
    help="Where --repo is cloned and checked out [default: ~/.drift/repos].",
)
@click.option(
    "--connect-timeout",
    type=click.FloatRange(min=0, min_open=True),
    default=15.0,
    show_default=True,
    metavar="SECONDS",
    help="How long each try to reach the coordinator may take (a slow relay path may need more).",
)
def join(
    repo: str,
    ticket: str,
    name: str | None,
    backend: str,
    device: str,
    devices: str | None,
    nproc: int | None,
    threads: int | None,
    key: Path | None,
    cache_dir: Path | None,
    connect_timeout: float,
) -> None:
    """Join a swarm: check out the task from REPO at the coordinator's commit, train, sync."""
    try:
        parse_ticket(ticket)
        ticket_run(ticket)
    except TransportError as e:
        _fail(str(e))
    from drift.ranks import RanksError, rank_devices
    from drift.workers import BackendError, choose

    try:  # fail before connecting when this machine cannot do what was asked
        ranks = rank_devices(devices, nproc, backend, device)
        if ranks is None:
            choose(backend, device)
    except (BackendError, RanksError) as e:
        _fail(str(e))
    if not repo.isprintable():
        _fail(f"--repo {repo!r}: contains control characters")
    if Path(repo).expanduser().exists():  # a path (else a URL): absolute, whatever the cwd later
        repo = str(Path(repo).expanduser().resolve())
    node_key = _key(key, "node", devices or device)
    try:
        lock = KeyLock(
            node_key.path,
            "give each node on a machine its own --device (each device gets its own key) or its own --key FILE",
        )
    except AuthError as e:
        _fail(str(e))
    # The task checkout is the only place task code imports from: not the directory this command
    # happens to run in (python -m puts it first on sys.path).
    sys.path[:] = [p for p in sys.path if p not in ("", os.getcwd())]
    from drift.loop import RepoSource, run_join

    opts = NodeOptions(
        ticket=ticket,
        source=RepoSource(repo, _absolute(cache_dir), backend=backend, device=device, threads=threads, ranks=ranks),
        steps=Steps(),
        key=node_key,
        say=lambda line: click.echo(f"drift: {line}", err=True),
        connect_timeout=connect_timeout,
        live=sys.stderr.isatty(),
    )
    if name:
        opts.name = name
    try:
        sys.exit(_run_sync(run_join, opts))
    finally:
        lock.release()


@main.command()
@click.argument("run_dir", required=False, type=click.Path(path_type=Path))
@click.option("--json", "as_json", is_flag=True, help="Print one JSON object (for machines).")
def status(run_dir: Path | None, as_json: bool) -> None:
    """What this machine can train with (GPUs, Apple Silicon, CPU, the backends installed); with
    RUN_DIR, how that run stands: round, nodes, losses, ETA."""
    import json

    if run_dir is not None:
        from drift.status import StatusError, run_status

        try:
            click.echo("\n".join(run_status(run_dir)))
        except StatusError as e:
            _fail(str(e))
        return

    from rich.console import Console

    from drift.workers.detect import detect, status_renderables

    info = detect()
    if as_json:
        click.echo(json.dumps(info.to_dict(), indent=2))
        return
    console = Console()
    for part in status_renderables(info):
        console.print(part, highlight=False)


@main.command()
@click.argument("run_dir", type=click.Path(path_type=Path))
@click.option("--prompt", default="\n", show_default="a newline", help="Text the sample continues.")
@click.option("-n", "--length", default=300, show_default=True, type=click.IntRange(1, 100_000), help="Tokens to add.")
@click.option(
    "--repo",
    type=click.Path(path_type=Path, file_okay=False),
    default=None,
    help="The task's repo (default: the git repo of the current directory).",
)
def sample(run_dir: Path, prompt: str, length: int, repo: Path | None) -> None:
    """Print text from the newest checkpoint of RUN_DIR (a task that defines sample(model, prompt, n))."""
    from drift.sample import SampleError, repo_of, sample_text

    try:
        click.echo(sample_text(run_dir, prompt, length, repo or repo_of(run_dir)))
    except SampleError as e:
        _fail(str(e))


@main.command()
@click.argument("run_dir", type=click.Path(path_type=Path))
@click.option("-o", "--out", type=click.Path(path_type=Path), default=None, help="Where the files go [RUN_DIR/export].")
@click.option("--merge", is_flag=True, help="A LoRA model: write the base with the adapter merged in, not the adapter.")
@click.option(
    "--repo", type=click.Path(path_type=Path), default=None, help="The task's repo [the one holding RUN_DIR]."
)
def export(run_dir: Path, out: Path | None, merge: bool, repo: Path | None) -> None:
    """Write the newest checkpoint of RUN_DIR as files loadable without drift (safetensors; save_pretrained)."""
    from drift.export import export as write
    from drift.sample import SampleError, repo_of

    out = out or run_dir / "export"
    try:
        names = write(run_dir, out, repo or repo_of(run_dir), merge)
    except SampleError as e:
        _fail(str(e))
    click.echo(f"{out}: {', '.join(names)}")


@main.command()
@click.argument("run_dirs", nargs=-1, required=True, type=click.Path(path_type=Path))
@click.option(
    "-o", "--out", type=click.Path(path_type=Path), default=None, help="Where the PNGs go (default: the first RUN_DIR)."
)
def report(run_dirs: tuple[Path, ...], out: Path | None) -> None:
    """Plot RUN_DIR/metrics.jsonl: loss.png, nodes.png, bytes.png (several runs overlay), and the
    run's page as one static file (dashboard.html; dashboard-RUN.html for each of several runs)."""
    from drift.dashboard import write_static
    from drift.monitor import read_events
    from drift.report import ReportError, load_run, summary, write_report

    try:
        runs = [load_run(d) for d in run_dirs]
        for line in (x for r in runs for x in r.skipped):
            click.echo(f"drift: warning: {line}", err=True)
        paths = write_report(runs, out or run_dirs[0])
        for d, run in zip(run_dirs, runs):
            name = "dashboard.html" if len(runs) == 1 else f"dashboard-{run.label}.html"
            paths.append(write_static(read_events(d), (out or run_dirs[0]) / name))
    except ReportError as e:
        _fail(str(e))
    except OSError as e:
        _fail(f"cannot write the plots: {e}")
    click.echo(summary(runs))
    for p in paths:
        click.echo(f"wrote {p}")
