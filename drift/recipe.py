"""Recipes: the YAML file that says what to train and how, validated up front.

A mistake in a recipe is reported as one line naming the file and the field
(``recipes/x.yaml: outer_optimizer.lr: Input should be a valid number``) before anything starts.
"""

from __future__ import annotations

import math
import re
import subprocess
from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, ValidationInfo, field_validator, model_validator
from pydantic_core import PydanticCustomError

from drift.sync import ALIASES, rules


class RecipeError(Exception):
    """A recipe that cannot be used; str() is shown to the user, one line per mistake."""


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


class InnerOptimizer(_Strict):
    """AdamW, run by every node between syncs."""

    lr: float = Field(3e-3, gt=0)
    weight_decay: float = Field(0.1, ge=0)
    beta1: float = Field(0.9, ge=0, lt=1)
    beta2: float = Field(0.95, ge=0, lt=1)
    grad_clip: float = Field(1.0, ge=0)


class LrSchedule(_Strict):
    """The inner learning rate as a function of the swarm's progress (samples trained so far),
    never of a node's own step count: nodes that steal work or join late use the same rate."""

    warmup_samples: int = Field(0, ge=0, description="linear warmup from 0 over the swarm's first N samples")
    min_lr: float | None = Field(
        None,
        ge=0,
        description="cosine decay from inner_optimizer.lr down to this at the run's last sample (default: no decay)",
    )


class OuterOptimizer(_Strict):
    """Nesterov SGD on the averaged pseudo-gradient, as in DiLoCo."""

    lr: float = Field(0.7, gt=0)
    momentum: float = Field(0.9, ge=0, lt=1)
    nesterov: bool = True


class Wandb(_Strict):
    """Weights & Biases: the coordinator logs the run's scalars there (the `wandb` extra)."""

    project: str = Field(min_length=1)
    entity: str | None = None
    name: str | None = Field(None, description="the W&B run's name (default: RECIPE-RUNID)")
    tags: list[str] = Field(default_factory=list)


class Data(_Strict):
    """The task's data lives with the coordinator: it opens the dataset and serves its samples
    (drift/data.py); a node that cannot open the same data itself fetches the samples it trains."""

    holder: Literal["coordinator"] = Field("coordinator", description="who serves the samples")
    cache_mb: float = Field(
        1024.0, gt=0, description="each node keeps at most this many MiB of fetched samples on disk"
    )


class Recipe(_Strict):
    name: str = Field(description="names the run directory, runs/NAME-TIME")
    task: str = Field(description="task file, relative to the repo root")
    task_config: dict[str, Any] = Field(default_factory=dict)
    init_weights: str | None = Field(
        None,
        description="a safetensors file or a save_pretrained directory (relative to the recipe file) on the "
        "coordinator only: its trainable tensors are θ₀, its frozen ones a LoRA's base; nodes fetch it once over "
        "drift-base/0, verified, and keep it in $DRIFT_HOME/base",
    )
    min_nodes: int = Field(1, ge=1)
    rounds: int = Field(ge=1)
    inner_steps: int = Field(ge=1, description="H: inner steps a node runs per round at equal speed")
    batch_size: int = Field(ge=1)
    unit_steps: int = Field(5, ge=1, description="inner steps per work unit")
    round_samples: int | None = Field(None, ge=1, description="default: min_nodes*inner_steps*batch_size")
    inner_optimizer: InnerOptimizer = Field(default_factory=InnerOptimizer)
    lr_schedule: LrSchedule = Field(default_factory=LrSchedule)
    micro_batches: int = Field(1, ge=1, description="gradient accumulation: each inner step's batch in this many parts")
    precision: Literal["fp32", "bf16", "fp16"] = Field(
        "fp32", description="bf16/fp16: torch autocast with float32 master weights (fp16 with loss scaling)"
    )
    outer_optimizer: OuterOptimizer = Field(default_factory=OuterOptimizer)
    sync: str = Field(
        "dense",
        description="the sync rule (drift/sync/): dense (DiLoCo: w·Δ all-reduced around a ring, outer "
        "Nesterov) or sparse (SparseLoCo-class: chunked top-k of error feedback, a sign bit a value, all-gathered); "
        "blocking / overlapped name dense (overlapped: with overlap on)",
    )
    sync_params: dict[str, Any] = Field(default_factory=dict, description="the sync rule's own hyperparameters")
    overlap: bool = Field(
        False,
        description="false: nodes wait for the sync and the outer step; true: they train the next round "
        "meanwhile, and the outer step lands a round late",
    )
    eval_batches: int = Field(8, ge=1)
    schedule: Literal["steal", "lockstep"] = Field(
        "steal",
        description="steal: shares by speed, idle nodes take unstarted units, the round stops "
        "at the next inner step once the budget is handed out; lockstep: every node "
        "does inner_steps, the barrier waits for the slowest (for comparison)",
    )
    slow_node_fraction: float = Field(
        0.05,
        gt=0,
        description="a node whose single inner step would take longer than this fraction of "
        "the round evaluates instead of training",
    )
    unit_deadline_factor: float = Field(
        4.0, gt=1, description="a unit not finished within this many times its expected time is reassigned"
    )
    quorum: float = Field(
        0.9,
        gt=0,
        le=1,
        description="the barrier goes on one inner step (at least 0.5 s) after nodes holding this share "
        "of the round's weight reached it; the rest merge their work into the next round (1: wait for every node)",
    )
    checkpoint_every: int = Field(5, ge=1, description="rounds between checkpoints (one is always written at the end)")
    keep_checkpoints: int = Field(3, ge=1)
    heartbeat_s: float = Field(2.0, gt=0)
    stale_after_s: float = Field(10.0, gt=0, description="a node silent this long is dropped")
    codec: Literal["fp32", "fp16", "bf16", "int8", "topk"] = Field(
        "int8", description="how the ring sends pseudo-gradients (drift/compress.py)"
    )
    topk_fraction: float = Field(0.01, gt=0, le=1, description="codec topk: share of values sent per chunk")
    network: Literal["auto", "local", "lan", "relay"] = Field(
        "auto",
        description="auto: this machine's addresses, plus iroh's relays when reachable; local: "
        "loopback only; lan: this machine's addresses, no relay; relay: relays required",
    )
    seed: int = 0
    commit: str | None = Field(None, description="pin nodes to this commit (default: the repo's HEAD)")
    allowlist: list[str] | str | None = Field(
        None, description="node ids admitted (a list, or a file of ids relative to the recipe); default: anyone"
    )
    wandb: Wandb | None = Field(None, description="log the run's scalars to Weights & Biases (coordinator only)")
    data: Data | None = Field(None, description="serve the task's data from the coordinator to nodes that lack it")
    auth_threshold: int | None = Field(
        None,
        ge=1,
        description="verified nodes the run needs; the swarm is cancelled once it cannot be met (default: min_nodes)",
    )

    @field_validator("name")
    @classmethod
    def _plain_name(cls, v: str) -> str:
        # It becomes a directory name under runs/: no path separators, no `..`, nothing hidden.
        if not re.fullmatch(r"[A-Za-z0-9_][A-Za-z0-9_.-]{0,99}", v):
            raise ValueError(
                f"{v[:40]!r} is not a plain name (letters, digits, '_', '.', '-', not starting with "
                f"'.' or '-'): it names the run directory runs/NAME-TIME"
            )
        return v

    @model_validator(mode="before")
    @classmethod
    def _sync_alias(cls, data: Any) -> Any:
        if isinstance(data, dict) and data.get("sync") in ALIASES:
            rule, overlap = ALIASES[data["sync"]]
            data = {**data, "sync": rule, **({"overlap": True} if overlap else {})}
        return data

    @field_validator("sync")
    @classmethod
    def _known_rule(cls, v: str) -> str:
        if v not in rules():
            raise PydanticCustomError(
                "sync",
                "{v} is not a sync rule ({names})",
                {"v": repr(v)[:60], "names": ", ".join([*rules(), *ALIASES])},
            )
        return v

    @field_validator("sync_params")
    @classmethod
    def _rule_params(cls, v: dict[str, Any], info: ValidationInfo) -> dict[str, Any]:
        rule = rules().get(info.data.get("sync", ""))
        if rule is None:
            return v
        try:
            rule.Params.model_validate(v)
        except ValidationError as e:
            what = "; ".join(
                _field_error(err) if err["loc"] else err["msg"].removeprefix("Value error, ") for err in e.errors()
            )
            raise PydanticCustomError(
                "sync_params", "{what} (sync: {rule})", {"what": what, "rule": rule.name}
            ) from None
        return v

    @model_validator(mode="after")
    def _budget(self) -> Recipe:
        if self.round_samples is None:
            self.round_samples = self.min_nodes * self.inner_steps * self.batch_size
        if self.micro_batches > self.batch_size:
            raise ValueError(f"micro_batches ({self.micro_batches}) cannot exceed batch_size ({self.batch_size})")
        if self.stale_after_s < 2 * self.heartbeat_s:  # a channel busy otherwise is pinged every 1.5 beats
            raise ValueError(
                f"stale_after_s ({self.stale_after_s:g}) must be at least twice heartbeat_s ({self.heartbeat_s:g}), "
                "or live nodes are taken for silent"
            )
        return self

    def inner_lr(self, samples: int) -> float:
        """The inner learning rate after the swarm trained `samples` samples: linear warmup, then
        cosine decay to lr_schedule.min_lr at the run's last sample (rounds * round_samples)."""
        lr, s = self.inner_optimizer.lr, self.lr_schedule
        if samples < s.warmup_samples:
            return lr * (samples + 1) / s.warmup_samples
        if s.min_lr is None:
            return lr
        total = self.rounds * (self.round_samples or 1)
        span = max(1, total - s.warmup_samples)
        t = min(1.0, (samples - s.warmup_samples) / span)
        return s.min_lr + 0.5 * (lr - s.min_lr) * (1 + math.cos(math.pi * t))

    def round_lr(self, progress: int) -> float:
        """The inner lr a node holds for a round that starts after the swarm trained `progress`
        samples: the schedule's value at the round's middle (every node of a round trains at it)."""
        return self.inner_lr(progress + (self.round_samples or 0) // 2)

    @property
    def unit_samples(self) -> int:
        return self.unit_steps * self.batch_size

    @property
    def units_per_round(self) -> int:
        assert self.round_samples is not None
        return max(1, -(-self.round_samples // self.unit_samples))


def repo_root(path: Path) -> Path:
    """The git work tree holding `path`, or its directory when it is not in one."""
    d = path.resolve().parent
    try:
        out = subprocess.run(
            ["git", "-C", str(d), "rev-parse", "--show-toplevel"], capture_output=True, text=True, timeout=10
        )
    except (OSError, subprocess.TimeoutExpired):
        return d
    return Path(out.stdout.strip()) if out.returncode == 0 else d


def load_recipe(path: str | Path, check_task: bool = True) -> Recipe:
    """Read and validate a recipe file; raise RecipeError with a one-line message."""
    p = Path(path)
    if not p.is_file():
        raise RecipeError(f"{p}: recipe file not found")
    try:
        raw = yaml.safe_load(p.read_text())
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        where = f" (line {mark.line + 1})" if mark else ""
        raise RecipeError(f"{p}: not valid YAML{where}: {getattr(e, 'problem', e)}") from None
    if not isinstance(raw, dict):
        raise RecipeError(f"{p}: a recipe is a YAML mapping of fields, got {type(raw).__name__}")
    try:
        recipe = Recipe.model_validate(raw)
    except ValidationError as e:  # every mistake at once, one line each
        raise RecipeError("\n".join(f"{p}: {_field_error(err)}" for err in e.errors())) from None
    if recipe.allowlist is not None:
        recipe.allowlist = _load_allowlist(p, recipe.allowlist)
    if recipe.init_weights is not None:
        w = (p.parent / recipe.init_weights).expanduser()
        if not w.exists():
            raise RecipeError(f"{p}: init_weights: {recipe.init_weights} not found")
        recipe.init_weights = str(w.resolve())
    if check_task:
        task = repo_root(p) / recipe.task
        if not task.is_file():
            raise RecipeError(f"{p}: task: file {recipe.task} not found under {repo_root(p)}")
    return recipe


def _field_error(err: dict) -> str:
    """'field.path: what is wrong' for one pydantic error."""
    field = ".".join(str(x) for x in err["loc"]) or "recipe"
    if err["type"] == "missing":
        return f"{field}: required field is missing"
    if err["type"] == "extra_forbidden":
        return f"{field}: unknown field"
    return f"{field}: {err['msg']}"


def _load_allowlist(recipe_path: Path, value: list[str] | str) -> list[str]:
    """The recipe's allowlist as sorted node ids; a string names a file (one id per line)."""
    from drift.auth import AuthError, parse_allowlist

    source, entries = f"{recipe_path}: allowlist", value
    if isinstance(value, str):
        f = (recipe_path.parent / value).expanduser()
        try:
            entries = f.read_text()
        except OSError as e:
            raise RecipeError(f"{recipe_path}: allowlist: cannot read {f}: {e.strerror}") from None
        source = f"{f}"
    try:
        return sorted(parse_allowlist(entries, source))
    except AuthError as e:
        raise RecipeError(str(e)) from None
