"""Your own training loop in a swarm: `drift.DiLoCo`, and `drift join` built on the same thing.

    with drift.DiLoCo(model, optimizer, ticket=TICKET, samples=len(train_set)) as swarm:
        for indices in swarm.batches():        # the samples of the units the coordinator granted
            loss = loss_fn(model, train_set[indices])
            optimizer.zero_grad(); loss.backward(); optimizer.step()

The node (handshake, trust, units, stealing, StopRound, barrier, all-reduce, outer step) runs in a
thread of its own; the loop runs where the user wrote it. `batches()` yields the indices of one
inner step at a time; the optimizer's step hook gives the step's loss. The node hands the loop a
unit's steps at a time (drift/inner.py, UnitSteps), so the loop's steps run back to back: nothing
waits on the node's thread between two of them, and a node costs its training. Whatever the node
does to the model (the pseudo-gradient, writing θ back after the outer step, evaluations) runs on
the loop's thread between two steps, inside `batches()`: never under the user's feet.

What comes from where: the coordinator's recipe holds the schedule (rounds, inner steps per round,
batch size, units, the outer optimizer, codec, deadlines, who evaluates); the script holds the
model, the inner optimizer (its learning rate is the script's: the recipe's `inner_optimizer` is
for task files) and the data (`samples`: how many training samples there are; indices are into
them). The recipe's `task:` names the script, and the script's repo must be clean at the commit
the coordinator names: every node runs that committed script, signed as with `drift join`.

`drift join --repo` is `run_join`: a RepoSource (a task file from a clean checkout) and a loop
that steps the task's worker. tests/wrappers/sim_node.py is another such loop (simulated devices).
"""

from __future__ import annotations

import asyncio
import math
import os
import sys
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Any

import numpy as np

from drift import protocol as P
from drift.auth import AuthError
from drift.inner import Steps
from drift.node import Node, NodeError, NodeOptions
from drift.ranks import start_group, task_worker
from drift.recipe import Recipe
from drift.repo import RepoCache, RepoError, dirty_files, resolve_commit, tree_of
from drift.ring import RingError
from drift.transport import TransportError
from drift.workers import Choice, choose


class NodeThread:
    """One node of a swarm, run for the thread that trains (see the module's docstring)."""

    def __init__(self, opts: NodeOptions) -> None:
        self.opts = opts
        self.steps: Steps = opts.steps
        self.code: int | None = None  # the node's exit code, once it ended
        self.error: BaseException | None = None
        self._thread: threading.Thread | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._task: asyncio.Task | None = None
        self.node: Node | None = None

    def __enter__(self) -> NodeThread:
        self._thread = threading.Thread(target=self._main, name="drift-node", daemon=True)
        self._thread.start()
        return self

    def _main(self) -> None:
        try:
            self.code = asyncio.run(self._run())
        except BaseException as e:
            self.error = e
        finally:
            self.steps.end()

    async def _run(self) -> int:
        self._loop, self._task = asyncio.get_running_loop(), asyncio.current_task()
        self.node = Node(self.opts)
        return await self.node.run()

    def batches(self, batch_size: int | None = None) -> Iterator[np.ndarray]:
        """The indices of each inner step's samples, until the run ends (the coordinator's
        recipe sets the batch size; one given here must be the same)."""
        for indices in self.steps.serve():
            if batch_size is not None and len(indices) > batch_size:
                raise NodeError(
                    f"batches({batch_size}): the coordinator's recipe trains batches of {len(indices)}; "
                    "set batch_size in the recipe (or call batches() without one)"
                )
            yield indices

    def stepped(self, loss: float = math.nan) -> None:
        """The inner step of the last batch is done, with this loss (DiLoCo's optimizer hook
        calls this; the step also ends when the loop asks for the next batch)."""
        self.steps.stepped(loss)

    @property
    def micro_batches(self) -> int:
        """How many parts the step in hand is accumulated over (the recipe's micro_batches)."""
        return self.steps.parts

    def __exit__(self, kind, exc, tb) -> None:
        self.steps.close()
        if self._thread is not None and self._thread.is_alive():
            if self._loop is not None and self._task is not None:
                self._loop.call_soon_threadsafe(self._task.cancel)  # the loop left early: leave the swarm
            self._thread.join(30.0)
        if kind is None and self.error is not None and not isinstance(self.error, asyncio.CancelledError):
            raise self.error


class DiLoCo(NodeThread):
    """A user's own torch loop as one node of a swarm: `with drift.DiLoCo(model, optimizer,
    ticket=T, samples=N) as swarm: for indices in swarm.batches(): ...`.

    ticket: what `drift coord` printed (default: $DRIFT_TICKET). samples: the number of training
    samples (indices are 0..samples-1). evaluate(model) -> val loss: optional; the coordinator
    asks some nodes to evaluate θ (a node without it reports none). key: this node's key file
    [default: ~/.drift/node.key]. The sync happens at the optimizer's step boundary: after the
    step that ends the node's share of a round, θ is averaged with the swarm and written back
    into the model before the next batch."""

    def __init__(
        self,
        model: Any,
        optimizer: Any,
        ticket: str | None = None,
        samples: int | None = None,
        evaluate: Callable[[Any], float] | None = None,
        key: str | os.PathLike | None = None,
        name: str | None = None,
    ) -> None:
        from drift.auth import KeyLock, default_key_path, load_or_create_key

        ticket = ticket or os.environ.get("DRIFT_TICKET")
        if not ticket:
            raise NodeError("drift.DiLoCo needs the ticket `drift coord` printed (ticket=... or $DRIFT_TICKET)")
        if samples is None or samples < 1:
            raise NodeError("drift.DiLoCo needs samples=N: how many training samples the indices are into")
        optimizer = _torch_optimizer(optimizer)
        main = getattr(sys.modules.get("__main__"), "__file__", None)
        if not main:
            raise NodeError("drift.DiLoCo runs from a script file (python train.py), whose repo the swarm checks")
        node_key = load_or_create_key(Path(key) if key else default_key_path("node"))
        self._lock = KeyLock(node_key.path, "give each node on a machine its own key (key=FILE, or $DRIFT_HOME)")
        opts = NodeOptions(
            ticket=ticket,
            source=ScriptSource(model, optimizer, int(samples), evaluate, Path(main).resolve()),
            steps=Steps(),
            key=node_key,
            say=lambda line: print(f"drift: {line}", file=sys.stderr, flush=True),
        )
        if name:
            opts.name = name
        super().__init__(opts)
        self._loss = math.nan  # the loss logged last (swarm.log(loss=...)): each step reports it
        self._logged, self._logged_round, self._pending, self._step = -math.inf, -1, {}, 0
        self._round, self._round_steps, self._fraction = -1, 0, 0.0
        self._hook = optimizer.register_step_post_hook(lambda *_: self._stepped())

    def _stepped(self) -> None:
        session = self.node.session if self.node is not None else None
        rnd = session.round if session is not None else -1
        if rnd > self._round:  # a later round: count its steps afresh
            self._round, self._round_steps = rnd, 0
        self._round_steps += 1
        self.stepped(self._loss)

    def log(self, step: int, **metrics: float) -> None:
        """Report this loop's metrics at its `step` (train loss as `loss=`, and up to 15 of your
        own) to the coordinator: its metrics.jsonl (`log` events), dashboard, W&B and TensorBoard.
        Call it as often as you like: at most one report a LOG_EVERY_S leaves (and the first of
        each round), the newest values."""
        for name, value in metrics.items():
            if not isinstance(value, (int, float)) and not hasattr(value, "item"):
                raise TypeError(f"swarm.log: {name}={value!r} is not a number")
            value = float(value)
            if math.isfinite(value):
                self._pending[name] = value
        if "loss" in self._pending:
            self._loss = self._pending["loss"]
        self._step = max(0, int(step))
        now = time.monotonic()
        session, loop = (self.node.session if self.node is not None else None), self._loop
        if session is None or session.round < 0 or loop is None:
            return
        if now - self._logged < P.LOG_EVERY_S and session.round <= self._logged_round:
            return
        try:
            msg = P.NodeLog(step=self._step, metrics=dict(list(self._pending.items())[: P.MAX_METRICS]))
        except ValueError as e:
            raise ValueError(f"swarm.log: {e.errors()[0]['msg']} ({', '.join(self._pending)})") from None
        self._logged, self._logged_round, self._pending = now, session.round, {}
        if self.code is not None or loop.is_closed():
            return  # the node has left the swarm (the run ended): nobody to tell
        coro = session.send(msg)
        try:
            asyncio.run_coroutine_threadsafe(coro, loop)  # a lost coordinator: the node says so
        except RuntimeError:  # the node's loop closed just now
            coro.close()

    @property
    def progress(self) -> Progress:
        """Where the swarm stands, for a schedule (e.g. a cosine LR over `progress.fraction`)."""
        t = self.node.trainer if self.node is not None else None
        if t is None:
            return Progress(0, 0, 0, 0, 0.0)
        session = self.node.session if self.node is not None else None
        # the round in hand: the one it stepped in last, or a later one it has not stepped in yet
        # (it evaluated the round before, or sat it out)
        rnd = max(self._round, session.round if session is not None else -1, 0)
        within = min(1.0, self._round_steps / t.recipe.inner_steps) if self._round == rnd else 0.0
        recipe = t.recipe
        total = recipe.rounds * (recipe.round_samples or 0)
        self._fraction = max(self._fraction, min(1.0, (rnd + within) / recipe.rounds))  # never goes back
        return Progress(rnd, recipe.rounds, rnd * (recipe.round_samples or 0), total, self._fraction)

    def __exit__(self, kind, exc, tb) -> None:
        self._hook.remove()
        try:
            super().__exit__(kind, exc, tb)
        except USER_ERRORS as e:  # one line, as `drift join` says it
            print(f"drift: error: {e}", file=sys.stderr, flush=True)
            raise SystemExit(1) from None
        finally:
            self._lock.release()


@dataclass(frozen=True)
class Progress:
    """The swarm's progress as a node sees it: the round in hand (0-based) of `rounds`; `samples`
    the swarm trained before it, of `total` (rounds × round_samples); `fraction` of the run done
    (rounds done, plus this node's steps into the round in hand over inner_steps), 0..1."""

    round: int
    rounds: int
    samples: int
    total: int
    fraction: float


def _torch_optimizer(optimizer: Any) -> Any:
    """The torch optimizer inside a wrapper (accelerate's AcceleratedOptimizer), whose step hooks fire."""
    inner = getattr(optimizer, "optimizer", None)
    return inner if type(optimizer).__name__ == "AcceleratedOptimizer" and inner is not None else optimizer


USER_ERRORS = (NodeError, RepoError, TransportError, RingError, AuthError)


# --- where the model comes from -----------------------------------------------------------------


class RepoSource:
    """`drift join --repo`: the task file of the recipe, from a clean checkout of the commit the
    coordinator names, built into a worker of the backend and device asked for."""

    def __init__(
        self,
        repo: str | Path,
        cache_dir: Path | None = None,
        backend: str = "auto",
        device: str = "auto",
        threads: int | None = None,
        ranks: list[str] | None = None,
    ) -> None:
        """ranks: the device of each rank when the node trains on several (drift/ranks.py)."""
        self.repo, self.cache_dir = repo, cache_dir
        self.backend, self.device, self.threads = backend, device, threads
        self.ranks = ranks if ranks and len(ranks) > 1 else None
        if ranks and len(ranks) == 1:
            self.device = ranks[0]
        self.cache: RepoCache | None = None
        self.worker: Any = None  # the loaded worker (for the loop that steps it)
        self.name = str(repo)

    def open(self) -> None:
        self.cache = RepoCache(self.repo, self.cache_dir)
        self.name = self.cache.source

    def choice(self) -> Choice:
        if self.ranks:
            return Choice("torch", "+".join(self.ranks))
        return choose(self.backend, self.device)

    async def load(self, cfg: P.TrainConfig, recipe: Recipe, data=None) -> tuple[Any, str | None]:
        """`data`: the task -> the task as this node trains it (drift.data.served_task), or None."""
        if self.ranks and data is not None:
            raise RepoError("served data (the recipe's data:) and several devices in one node do not work together yet")
        loop = asyncio.get_running_loop()
        work = await loop.run_in_executor(None, self.cache.checkout, cfg.commit or "")
        tree = self.cache.tree(work)
        task_path = self.cache.task_path(work, recipe.task)
        if self.ranks:
            build = partial(start_group, work, task_path, recipe, self.ranks, self.threads)
        else:
            build = partial(task_worker, work, task_path, recipe, self.backend, self.device, self.threads, data)
        self.worker = await loop.run_in_executor(None, build)
        return self.worker, tree


class ScriptSource:
    """drift.DiLoCo: the running script's own model and optimizer, if its repo is clean at the
    commit the coordinator names and the recipe's task is this script."""

    def __init__(self, model, optimizer, samples: int, evaluate, script: Path) -> None:
        self.model, self.optimizer, self.samples, self.evaluate = model, optimizer, samples, evaluate
        self.script = script
        self.root: Path | None = None
        self.name = str(script.parent)

    def open(self) -> None:
        try:
            import git

            self.root = Path(git.Repo(self.script.parent, search_parent_directories=True).working_tree_dir).resolve()
        except Exception:
            raise RepoError(
                f"{self.script} is not in a git repository: a swarm runs committed code (git init && git commit)"
            ) from None
        self.name = str(self.root)

    def choice(self) -> Choice:
        first = next(iter(self.model.parameters()), None)
        return Choice("torch", str(first.device) if first is not None else "cpu")

    async def load(self, cfg: P.TrainConfig, recipe: Recipe, data=None) -> tuple[Any, str | None]:
        from drift.workers.torch_worker import TorchWorker  # (data: the script's own loop reads its data)

        root, commit = self.root, cfg.commit or ""
        head = resolve_commit(root, "HEAD")
        if head != commit:
            raise RepoError(
                f"{root} is at commit {head[:12]}, the coordinator runs {commit[:12]}: "
                f"check out that commit (git checkout {commit[:12]}) and start the script again"
            )
        dirty = dirty_files(root)
        if dirty:
            shown = ", ".join(dirty[:3]) + (", ..." if len(dirty) > 3 else "")
            raise RepoError(f"{root} has uncommitted changes ({shown}): the swarm runs committed code only")
        task = (root / recipe.task).resolve()
        if task != self.script:
            raise RepoError(f"the coordinator's recipe runs {recipe.task}, and this is {self.script.relative_to(root)}")
        return TorchWorker.around(self.model, self.optimizer, self.samples, self.evaluate), tree_of(root, commit)


def run_join(opts: NodeOptions) -> int:
    """`drift join`: the task's worker trains each batch the swarm hands out (one code path with
    drift.DiLoCo: only the loop differs)."""
    with NodeThread(opts) as swarm:
        for indices in swarm.batches():
            swarm.stepped(opts.source.worker.train_step(indices, swarm.micro_batches))
    return swarm.code if swarm.code is not None else 1
