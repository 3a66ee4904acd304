"""What the coordinator shows and records: metrics.jsonl in the run directory (with nodes.jsonl
beside it for the per-node lines of a swarm of more than ROUND_ROWS members), TensorBoard event
files (when the `tensorboard` extra is installed: one scalar per round per metric), and a live
table (rich) when stdout is a terminal, plain log lines otherwise.

Names, devices and reasons come from the network: they are shown as plain text (never rich
markup, highlighting or emoji codes), one line each (protocol.printable)."""

from __future__ import annotations

import asyncio
import json
import logging
import sys
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.live import Live
from rich.table import Table
from rich.text import Text

from drift.protocol import MAX_NAME, printable

log = logging.getLogger("drift.monitor")

JOIN_LINES = 16  # nodes named as they join; after them one line each time the count doubles
TABLE_ROWS = 16  # nodes in the live table: the slowest; one more row sums up the rest
ROUND_ROWS = 16  # node rows a round event keeps in metrics.jsonl: every member's up to this many,
# else the slowest to the barrier and a summary of all; every row goes to nodes.jsonl (`rows_at`),
# and so do the units' progress events of a swarm of more members than this
ROW_TIMES = ("busy_s", "step_s", "idle_s", "sync_s", "check_s")  # a summary's min, median, max
ROW_SUMS = ("samples", "steps", "bytes_sent", "units_after_stop")  # a summary's totals


@dataclass
class NodeView:
    name: str
    device: str
    samples_per_s: float = 0.0
    loss: float | None = None
    samples: int = 0
    bytes_sent: int = 0


@dataclass
class Monitor:
    run_dir: Path
    live: bool = field(default_factory=lambda: sys.stdout.isatty())
    nodes: dict[str, NodeView] = field(default_factory=dict)
    round: int = 0
    rounds: int = 0
    val_loss: float | None = None
    round_samples: int = 0  # the round's budget: the live table's progress bar
    subscribers: list[Callable[[dict[str, Any]], None]] = field(default_factory=list)  # each event, as written

    def __post_init__(self) -> None:
        path = self.run_dir / "metrics.jsonl"
        try:
            self.run_dir.mkdir(parents=True, exist_ok=True)
            _cut_torn_line(path)
            self._metrics = open(path, "a", buffering=1)
        except OSError as e:
            raise RunDirError(f"cannot write {path}: {e.strerror or e}") from None
        # Why metrics.jsonl could not be written (a full disk, a read-only mount), once it could
        # not: events are dropped from then on and `failed` is set, for the run to end cleanly.
        self.error: str | None = None
        self.failed = asyncio.Event()
        self._t0 = time.time()
        self.console = Console(stderr=False)
        self._live: Live | None = None
        self._eta = Eta()
        if self.live:
            self._live = Live(self, console=self.console, refresh_per_second=4)
            self._live.start()
        self._board = Board.open(self.run_dir)
        self._rows: Any = None  # nodes.jsonl: the per-node lines of a swarm of more than ROUND_ROWS
        self._joined = 0  # node_joined events so far (the terminal names the first JOIN_LINES)

    def fail(self, error: str) -> None:
        """The run dir cannot be written (metrics or a checkpoint): the run is to end cleanly."""
        if self.error is None:
            self.error = error
            self.failed.set()

    def event(self, kind: str, **fields: Any) -> None:
        """Record one event (a line of metrics.jsonl) and refresh the view."""
        rec = {"t": round(time.time() - self._t0, 3), "event": kind, **fields}
        if self.error is None:
            try:
                if kind == "progress" and len(self.nodes) > ROUND_ROWS:  # a thousand lines a round
                    self._detail(rec)
                elif kind == "round" and len(rec.get("nodes") or ()) > ROUND_ROWS:
                    at = self._detail({"t": rec["t"], "event": "rows", "round": rec["round"], "nodes": rec["nodes"]})
                    self._metrics.write(json.dumps(cut_round(rec, at)) + "\n")
                else:
                    self._metrics.write(json.dumps(rec) + "\n")
            except OSError as e:
                self.fail(f"cannot write {self.run_dir / 'metrics.jsonl'}: {e.strerror or e}")
        if self._board is not None:
            self._board.event(rec)
        self._eta.event(rec)
        for sub in self.subscribers:
            try:
                sub(rec)
            except Exception:  # a page or a tracker must never end the run
                log.exception("monitor: a subscriber failed on a %s event", kind)
        if self._live:  # rich redraws the table (__rich__) 4 times a second; one built at each event
            return  # was 0.3 ms an event at a thousand nodes: most of a second of the coordinator's a round
        if kind == "node_joined":
            self._joined += 1
            if self._joined <= JOIN_LINES:
                self.say(_line(rec))
            elif self._joined & (self._joined - 1) == 0:  # a swarm of a thousand: ~6 lines, not 1,000
                self.say(f"nodes joined: {self._joined} (the last: {printable(rec['name'], MAX_NAME)})")
        elif kind in ("initial", "round", "complete", "error", "node_left"):
            eta = f"  ETA {_duration(self._eta.seconds_left(self.rounds, rec['t']))}" if kind == "round" else ""
            self.say(_line(rec) + eta)

    def _detail(self, rec: dict[str, Any]) -> int:
        """A line of nodes.jsonl (a round's rows, a unit's progress); returns where it starts."""
        if self._rows is None:
            path = self.run_dir / "nodes.jsonl"
            _cut_torn_line(path)
            self._rows = open(path, "ab")
        at = self._rows.tell()
        self._rows.write(json.dumps(rec).encode() + b"\n")
        self._rows.flush()  # (before the round event that points at it)
        return at

    def say(self, text: str) -> None:
        """Print one line as it is: no markup, no highlighting, no emoji codes."""
        self.console.print(text, markup=False, highlight=False, emoji=False, soft_wrap=True)

    def __rich__(self) -> Table:
        """The live table: the slowest nodes, then the rest summed up."""
        return self._table()

    def _table(self) -> Table:
        vl = f"{self.val_loss:.3f}" if self.val_loss is not None else "-"
        t = Table(
            title=Text(  # as text: the bar's brackets are no markup
                f"drift  round {self.round}/{self.rounds} "
                f"{self._eta.bar(self.round_samples, self.rounds, time.time() - self._t0)}  val loss {vl}"
            )
        )
        for col in ("node", "device", "samples/s", "loss", "samples", "MiB sent"):
            t.add_column(col, justify="right" if col not in ("node", "device") else "left")
        nodes = list(self.nodes.values())
        if len(nodes) > TABLE_ROWS:  # the slowest, then the rest summed up: readable at a thousand nodes
            nodes.sort(key=lambda n: n.samples_per_s)
            nodes, rest = nodes[:TABLE_ROWS], nodes[TABLE_ROWS:]
            t.caption = (
                f"{len(rest)} faster nodes not shown: {sum(n.samples_per_s for n in rest):.0f} samples/s, "
                f"{sum(n.samples for n in rest)} samples, {sum(n.bytes_sent for n in rest) / 2**20:.1f} MiB sent"
            )
        for n in nodes:
            t.add_row(
                Text(printable(n.name, MAX_NAME)),
                Text(printable(n.device, MAX_NAME)),
                f"{n.samples_per_s:.0f}",
                f"{n.loss:.3f}" if n.loss is not None else "-",
                str(n.samples),
                f"{n.bytes_sent / 2**20:.1f}",
            )
        return t

    def close(self) -> None:
        if self._live:
            self._live.stop()
        for f in (self._metrics, self._rows):
            try:
                if f is not None:
                    f.close()
            except OSError:  # the buffer could not be flushed: `error` says so already
                pass
        if self._board is not None:
            self._board.close()


def cut_round(rec: dict[str, Any], rows_at: int) -> dict[str, Any]:
    """A round event of more than ROUND_ROWS node rows as metrics.jsonl keeps it: the rows of the
    ROUND_ROWS members last to reach the barrier (the round's stragglers), a `summary` of every
    member's (how many, by role, counted; the totals; each time's min, median and max), and
    `rows_at`, where nodes.jsonl holds all of them (read_events(whole=True) puts them back)."""
    rows = rec["nodes"]
    slowest = sorted(rows, key=lambda k: (-float(rows[k].get("busy_s") or 0.0), k))[:ROUND_ROWS]
    summary: dict[str, Any] = {
        "members": len(rows),
        "train": sum(r.get("role") != "evaluate" for r in rows.values()),
        "evaluate": sum(r.get("role") == "evaluate" for r in rows.values()),
        "counted": sum((r.get("weight") or 0) > 0 for r in rows.values()),
        **{f: sum(r.get(f) or 0 for r in rows.values()) for f in ROW_SUMS},
    }
    for f in ROW_TIMES:
        summary[f] = _spread(float(r.get(f) or 0.0) for r in rows.values())
    return {**rec, "nodes": {k: rows[k] for k in slowest}, "summary": summary, "rows_at": rows_at}


def read_events(run_dir: Path, whole: bool = False) -> list[dict]:
    """RUN_DIR/metrics.jsonl as event dicts; a line that is not one (torn by a full disk, or
    being written right now) is left out. `whole`: a round event cut to its slowest members
    (`cut_round`) gets all its rows back from nodes.jsonl."""
    events = []
    for line in (Path(run_dir) / "metrics.jsonl").read_text(errors="replace").splitlines():
        try:
            e = json.loads(line)
        except ValueError:
            continue
        if isinstance(e, dict) and "event" in e:
            events.append(e)
    if whole:
        attach_rows(run_dir, events)
    return events


def attach_rows(run_dir: Path, events: list[dict]) -> None:
    """Give each round event cut to its slowest members (`cut_round`) all its rows again, from
    RUN_DIR/nodes.jsonl. Raises ValueError, naming the file, where they are not there."""
    cut = [e for e in events if e.get("event") == "round" and isinstance(e.get("rows_at"), int)]
    if not cut:
        return
    path = Path(run_dir) / "nodes.jsonl"
    with open(path, "rb") as fh:
        for e in cut:
            fh.seek(e["rows_at"])
            try:
                rows = json.loads(fh.readline())
            except ValueError:
                rows = {}
            if not isinstance(rows, dict) or rows.get("event") != "rows" or rows.get("round") != e["round"]:
                raise ValueError(f"{path}: no rows of round {e['round']} at byte {e['rows_at']}")
            e["nodes"] = rows.get("nodes") or {}


class RunDirError(Exception):
    """The run directory cannot be written; str() is the one line shown to the user."""


def _cut_torn_line(path: Path) -> None:
    """A process killed mid-write (kill -9) leaves a last line without its newline: cut it, so
    the next run's first event (after --resume) does not become part of a broken line."""
    if not path.is_file():
        return
    with open(path, "rb+") as fh:
        size = fh.seek(0, 2)
        if size == 0:
            return
        fh.seek(size - 1)
        if fh.read(1) == b"\n":
            return
        pos = size
        while pos > 0:  # back to the last newline, a block at a time
            step = min(pos, 1 << 16)
            fh.seek(pos - step)
            block = fh.read(step)
            nl = block.rfind(b"\n")
            if nl >= 0:
                fh.truncate(pos - step + nl + 1)
                return
            pos -= step
        fh.truncate(0)


class Board:
    """TensorBoard scalars from the run's events (`tensorboard --logdir RUN_DIR`): per round the
    losses, throughput, sync time and bytes, per node its utilization; evaluators' val losses."""

    def __init__(self, writer, event_cls, summary_cls) -> None:
        self._w, self._event, self._summary = writer, event_cls, summary_cls

    @classmethod
    def open(cls, run_dir: Path) -> Board | None:
        """A writer in run_dir, or None when tensorboard is not installed (pip install -e '.[tensorboard]')."""
        try:
            from tensorboard.compat.proto.event_pb2 import Event
            from tensorboard.compat.proto.summary_pb2 import Summary
            from tensorboard.summary.writer.event_file_writer import EventFileWriter
        except ImportError:
            return None
        return cls(EventFileWriter(str(run_dir)), Event, Summary)

    def scalars(self, step: int, values: dict[str, float | None]) -> None:
        value = [self._summary.Value(tag=k, simple_value=float(v)) for k, v in values.items() if v is not None]
        if value:
            self._w.add_event(self._event(wall_time=time.time(), step=step, summary=self._summary(value=value)))

    def event(self, rec: dict[str, Any]) -> None:
        for step, values in scalars(rec):
            self.scalars(step, values)
        if rec["event"] == "round":
            self._w.flush()

    def close(self) -> None:
        self._w.close()


class Eta:
    """The round in progress (samples trained so far, from progress events) and the run's ETA
    (the mean round so far times the rounds left), for the live table's title."""

    def __init__(self) -> None:
        self.started: float | None = None  # time of training_started (run clock)
        self.first: int | None = None  # the first round this coordinator ran (a resumed run starts later)
        self.done = 0  # rounds finished, counting from round 0
        self.last_t = 0.0
        self.units: dict[int, dict[tuple, int]] = {}  # per unfinished round: the units reported, samples each

    def event(self, rec: dict[str, Any]) -> None:
        kind, t = rec["event"], rec["t"]
        if kind == "training_started" and self.started is None:
            self.started = t
        elif kind == "round":
            rnd = int(rec["round"])
            self.first = rnd if self.first is None else self.first
            self.done, self.last_t = rnd + 1, t
            self.units = {k: v for k, v in self.units.items() if k > rnd}
        elif kind == "progress" and isinstance(rec.get("round"), int) and rec["round"] >= self.done:
            u = rec["unit"]
            self.units.setdefault(rec["round"], {})[tuple(u)] = int(u[3]) - int(u[2])

    def seconds_left(self, rounds: int, now: float) -> float | None:
        """Seconds until round `rounds` ends, at the pace of the rounds so far; None before one ended."""
        if self.started is None or self.first is None:
            return None
        per_round = (self.last_t - self.started) / (self.done - self.first)
        return max(0.0, per_round * (rounds - self.done) - (now - self.last_t))

    def bar(self, budget: int, rounds: int, now: float, width: int = 20) -> str:
        """`[#######.............] 35%  ETA 1m20s` for the round in progress."""
        current = self.units.get(max(self.units, default=self.done), {})  # (overlapped: the newer round)
        frac = min(1.0, sum(current.values()) / budget) if budget else 0.0
        fill = round(frac * width)
        left = self.seconds_left(rounds, now)
        return f"[{'#' * fill}{'.' * (width - fill)}] {100 * frac:.0f}%  ETA {_duration(left)}"


def scalars(rec: dict[str, Any]) -> list[tuple[int, dict[str, float | None]]]:
    """The scalars an event makes, as (round, {name: value}): per round the losses, throughput,
    sync time and bytes, per node its utilization; evaluators' val losses. TensorBoard and
    Weights & Biases log the same ones."""
    kind = rec["event"]
    if kind == "round":
        secs = rec.get("seconds")
        return [
            (
                rec["round"],
                {
                    "loss/val": rec.get("val_loss"),
                    "loss/train": rec.get("train_loss"),
                    "round/seconds": secs,
                    "round/samples": rec.get("samples"),
                    "round/samples_per_s": rec["samples"] / secs if secs else None,
                    "sync/reduce_s": rec.get("reduce_s"),
                    "sync/MiB_sent": rec.get("bytes_sent", 0) / 2**20,
                    **_utilization(rec.get("nodes", {}), secs),
                    **_task_metrics(rec),
                },
            )
        ]
    if kind == "log":  # a node's own metrics (swarm.log), at its own step
        return [(rec["step"], {f"log/{printable(rec['name'], MAX_NAME)}/{k}": v for k, v in rec["metrics"].items()})]
    if kind == "initial":
        return [(-1, {"loss/val": rec["val_loss"], **_task_metrics(rec)})]
    if kind == "val":
        return [(rec["after_round"], {"loss/val_evaluator": rec["val_loss"], **_task_metrics(rec, "_evaluator")})]
    return []


def _utilization(rows: dict[str, Any], secs: float | None) -> dict[str, float]:
    """Each node's share of the round in inner steps; of more than ROUND_ROWS nodes, the min,
    median and max share (a thousand nodes' chart is three lines, not a thousand)."""
    shares = {printable(k, MAX_NAME): n["step_s"] / secs for k, n in rows.items() if secs and "step_s" in n}
    return {
        f"utilization/{k}": v for k, v in (shares if len(shares) <= ROUND_ROWS else _spread(shares.values())).items()
    }


def _spread(values: Iterable[float]) -> dict[str, float]:
    """The least, the median and the most of some values (at least one)."""
    v = sorted(values)
    return {"min": v[0], "median": v[len(v) // 2], "max": v[-1]}


def _duration(s: float | None) -> str:
    if s is None:
        return "-"
    s = round(s)
    h, m, x = s // 3600, s % 3600 // 60, s % 60
    return f"{h}h{m:02d}m" if h else f"{m}m{x:02d}s" if m else f"{x}s"


def _task_metrics(rec: dict[str, Any], suffix: str = "") -> dict[str, float]:
    """The task's own metrics of an event as scalars (`metrics/accuracy`)."""
    return {f"metrics/{k}{suffix}": v for k, v in (rec.get("metrics") or {}).items()}


def _metrics(rec: dict[str, Any]) -> str:
    """The task's metrics for a line, e.g. "  val accuracy 0.9312" (names are plain ASCII: the
    wire checks them)."""
    return "".join(f"  val {k} {v:.4g}" for k, v in (rec.get("metrics") or {}).items())


def _line(rec: dict[str, Any]) -> str:
    kind = rec["event"]
    if kind == "round":
        vl = f"{rec['val_loss']:.4f}" if rec.get("val_loss") is not None else "-"
        tl = f"{rec['train_loss']:.4f}" if rec.get("train_loss") is not None else "-"
        return (
            f"round {rec['round']:>3}  train {tl}  val {vl}  samples {rec['samples']}  "
            f"{rec['seconds']:.1f}s  sync {rec['reduce_s']:.2f}s  {rec['bytes_sent'] / 2**20:.1f} MiB sent"
            f"{_metrics(rec)}"
        )
    if kind == "initial":
        return f"initial val loss {rec['val_loss']:.4f}{_metrics(rec)}"
    if kind == "node_joined":
        return (
            f"node joined: {printable(rec['name'], MAX_NAME)} ({printable(rec['device'], MAX_NAME)}) "
            f"{printable(str(rec['node_id'])[:10])}"
        )
    if kind == "complete":
        vl = rec.get("final_val_loss")
        loss = f", final val loss {vl:.4f}" if vl is not None else ""
        return f"run complete: {rec['rounds']} rounds trained{loss}"
    if kind == "node_left":
        why = f" ({printable(rec['reason'])})" if rec.get("reason") else ""
        return f"node left: {printable(rec.get('name', '?'), MAX_NAME)}{why}"
    return " ".join(f"{k}={printable(v)}" for k, v in rec.items() if k != "t")
