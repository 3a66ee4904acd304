"""What a node shows its operator while it trains: joined, then one line a round (its loss, the
bytes it sent, its share of the round's samples, an ETA). On a terminal the round line is a rich
live line that redraws in place; otherwise (a log file, `--local`'s node-N.log) plain lines."""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field

from rich.console import Console
from rich.live import Live
from rich.text import Text


def _bytes(n: int) -> str:
    for unit in ("B", "kB", "MB", "GB"):
        if n < 1000 or unit == "GB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1000
    return f"{n} B"  # (not reached)


def _duration(s: float) -> str:
    s = int(s)
    return f"{s // 3600}h{s % 3600 // 60:02d}m" if s >= 3600 else f"{s // 60}m{s % 60:02d}s"


@dataclass
class Progress:
    """Round lines for one node; `say` prints a plain line, `live` draws a redrawn line instead."""

    say: Callable[[str], None]
    live: bool = False
    rounds: int = 0  # the run's rounds (for the ETA), known once the recipe is
    _trained: dict[int, tuple[int, float | None]] = field(default_factory=dict)  # round -> (samples, loss)
    _started: float | None = None
    _first: int | None = None  # the first round this node saw settle (the ETA counts from there)
    _live: Live | None = None

    def joined(self, coordinator: str, run: str, nodes: int) -> None:
        """The swarm admitted this node."""
        self.say(f"joined run {run} at coordinator {coordinator[:10]}: {nodes} node(s), training")

    def trained(self, rnd: int, samples: int, loss: float | None) -> None:
        """This node finished its share of round `rnd` (the line waits for the round to settle)."""
        if self._started is None:
            self._started = time.monotonic()
        self._trained[rnd] = (samples, loss)

    def evaluated(self, rnd: int, val_loss: float) -> None:
        """This node evaluated the swarm's θ instead of training this round."""
        self._show(f"round {rnd + 1}/{self.rounds}: evaluated (this node trains no samples), val loss {val_loss:.4f}")

    def settled(
        self,
        rnd: int,
        bytes_sent: int,
        val_loss: float | None,
        weight: float | None = None,
        abandoned: bool = False,
        kept: float = 0.0,
    ) -> None:
        """Round `rnd` is settled here: one line with what this node knows of it. `weight`: this
        node's share of the round's samples, as the coordinator counted them (its ring weight);
        `kept`: the round went on without this node, which keeps that share of its Δ for the next."""
        samples, loss = self._trained.pop(rnd, (0, None))
        self._trained = {r: v for r, v in self._trained.items() if r > rnd}
        share = f"trained {samples} samples" + (f" ({100 * weight:.0f}% of the round)" if weight is not None else "")
        if kept:
            share += f" (late: {100 * kept:.0f}% of its Δ rides into round {rnd + 2})"
        parts = [f"round {rnd + 1}/{self.rounds}" + (" (given up: θ kept)" if abandoned else ""), share]
        if loss is not None:
            parts.append(f"train loss {loss:.4f}")
        if val_loss is not None:
            parts.append(f"val loss {val_loss:.4f}")
        parts.append(f"sent {_bytes(bytes_sent)}")
        if self._first is None:
            self._first = rnd
        done = rnd - self._first + 1
        if self._started is not None and self.rounds > rnd + 1:
            per_round = (time.monotonic() - self._started) / done
            parts.append(f"ETA {_duration(per_round * (self.rounds - rnd - 1))}")
        self._show(", ".join(parts))

    def _show(self, line: str) -> None:
        if not self.live:
            self.say(line)
            return
        text = Text(f"drift: {line}")
        if self._live is None:
            self._live = Live(text, console=Console(stderr=True), auto_refresh=False, transient=False)
            self._live.start()
        self._live.update(text, refresh=True)

    def close(self) -> None:
        """Leave the live line as it last stood."""
        if self._live is not None:
            self._live.stop()
            self._live = None
