"""What the coordinator shows and records: metrics.jsonl in the run directory, and a live table
(rich) when stdout is a terminal, plain log lines otherwise.

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

    def event(self, kind: str, **fields: Any) -> None:
        """Record one event (a line of metrics.jsonl) and refresh the view."""
        rec = {"t": round(time.time() - self._t0, 3), "event": kind, **fields}
        self._metrics.write(json.dumps(rec) + "\n")
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
            t.add_row(Text(printable(n.name, MAX_NAME)), Text(printable(n.device, MAX_NAME)), f"{n.samples_per_s:.0f}",
                      f"{n.loss:.3f}" if n.loss is not None else "-", str(n.samples),
                      f"{n.bytes_sent / 2**20:.1f}")
        return t

    def close(self) -> None:
        if self._live:
            self._live.stop()
        self._metrics.close()


def _line(rec: dict[str, Any]) -> str:
    kind = rec["event"]
    if kind == "round":
        vl = f"{rec['val_loss']:.4f}" if rec.get("val_loss") is not None else "-"
        tl = f"{rec['train_loss']:.4f}" if rec.get("train_loss") is not None else "-"
        return (f"round {rec['round']:>3}  train {tl}  val {vl}  samples {rec['samples']}  "
                f"{rec['seconds']:.1f}s  sync {rec['reduce_s']:.2f}s  {rec['bytes_sent'] / 2**20:.1f} MiB sent")
    if kind == "initial":
        return f"initial val loss {rec['val_loss']:.4f}"
    if kind == "node_joined":
        return (f"node joined: {printable(rec['name'], MAX_NAME)} ({printable(rec['device'], MAX_NAME)}) "
                f"{printable(str(rec['node_id'])[:10])}")
    return " ".join(f"{k}={printable(v)}" for k, v in rec.items() if k != "t")
