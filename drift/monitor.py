"""What the coordinator shows and records: metrics.jsonl in the run directory, TensorBoard event
files beside it (when the `tensorboard` extra is installed: one scalar per round per metric), and
a live table (rich) when stdout is a terminal, plain log lines otherwise.

Names, devices and reasons come from the network: they are shown as plain text (never rich
markup, highlighting or emoji codes), one line each (protocol.printable)."""

from __future__ import annotations

import json
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.live import Live
from rich.table import Table
from rich.text import Text

from drift.protocol import MAX_NAME, printable


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

    def __post_init__(self) -> None:
        self.run_dir.mkdir(parents=True, exist_ok=True)
        self._metrics = open(self.run_dir / "metrics.jsonl", "a", buffering=1)
        self._t0 = time.time()
        self.console = Console(stderr=False)
        self._live: Live | None = None
        if self.live:
            self._live = Live(self._table(), console=self.console, refresh_per_second=4)
            self._live.start()
        self._board = Board.open(self.run_dir)

    def event(self, kind: str, **fields: Any) -> None:
        """Record one event (a line of metrics.jsonl) and refresh the view."""
        rec = {"t": round(time.time() - self._t0, 3), "event": kind, **fields}
        self._metrics.write(json.dumps(rec) + "\n")
        if self._board is not None:
            self._board.event(rec)
        if self._live:
            self._live.update(self._table())
        elif kind in ("node_joined", "initial", "round", "complete", "error", "node_left"):
            self.say(_line(rec))

    def say(self, text: str) -> None:
        """Print one line as it is: no markup, no highlighting, no emoji codes."""
        self.console.print(text, markup=False, highlight=False, emoji=False, soft_wrap=True)

    def _table(self) -> Table:
        vl = f"{self.val_loss:.3f}" if self.val_loss is not None else "-"
        t = Table(title=f"drift  round {self.round}/{self.rounds}  val loss {vl}")
        for col in ("node", "device", "samples/s", "loss", "samples", "MiB sent"):
            t.add_column(col, justify="right" if col not in ("node", "device") else "left")
        for n in self.nodes.values():
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
        self._metrics.close()
        if self._board is not None:
            self._board.close()


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
        kind = rec["event"]
        if kind == "round":
            step = rec["round"]
            self.scalars(
                step,
                {
                    "loss/val": rec.get("val_loss"),
                    "loss/train": rec.get("train_loss"),
                    "round/seconds": rec.get("seconds"),
                    "round/samples": rec.get("samples"),
                    "round/samples_per_s": rec["samples"] / rec["seconds"] if rec.get("seconds") else None,
                    "sync/reduce_s": rec.get("reduce_s"),
                    "sync/MiB_sent": rec.get("bytes_sent", 0) / 2**20,
                },
            )
            self.scalars(
                step,
                {
                    f"utilization/{printable(name, MAX_NAME)}": n["step_s"] / rec["seconds"]
                    for name, n in rec.get("nodes", {}).items()
                    if rec.get("seconds") and "step_s" in n
                },
            )
            self._w.flush()
        elif kind == "initial":
            self.scalars(-1, {"loss/val": rec["val_loss"]})
        elif kind == "val":
            self.scalars(rec["after_round"], {"loss/val_evaluator": rec["val_loss"]})

    def close(self) -> None:
        self._w.close()


def _line(rec: dict[str, Any]) -> str:
    kind = rec["event"]
    if kind == "round":
        vl = f"{rec['val_loss']:.4f}" if rec.get("val_loss") is not None else "-"
        tl = f"{rec['train_loss']:.4f}" if rec.get("train_loss") is not None else "-"
        return (
            f"round {rec['round']:>3}  train {tl}  val {vl}  samples {rec['samples']}  "
            f"{rec['seconds']:.1f}s  sync {rec['reduce_s']:.2f}s  {rec['bytes_sent'] / 2**20:.1f} MiB sent"
        )
    if kind == "initial":
        return f"initial val loss {rec['val_loss']:.4f}"
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
