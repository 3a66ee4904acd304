"""The coordinator's view stays readable with a thousand nodes (issue 40): its terminal names the
first nodes that join and then counts them, and the live table shows the slowest nodes and sums
up the rest, instead of a line or a row per node."""

from __future__ import annotations

import io
from pathlib import Path

import pytest
from rich.console import Console

from drift.monitor import JOIN_LINES, TABLE_ROWS, Monitor, NodeView


def test_a_thousand_joins_are_a_few_lines(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    monitor = Monitor(tmp_path / "run", live=False)
    try:
        for i in range(1000):
            monitor.event("node_joined", node_id=f"{i:064x}", name=f"n{i}", device="cpu")
    finally:
        monitor.close()
    out = capsys.readouterr().out.splitlines()
    named = [line for line in out if line.startswith("node joined: ")]
    assert [line.split()[2] for line in named] == [f"n{i}" for i in range(JOIN_LINES)]
    counts = [line for line in out if line.startswith("nodes joined: ")]
    assert counts == [f"nodes joined: {k} (the last: n{k - 1})" for k in (32, 64, 128, 256, 512)]
    assert len(out) == JOIN_LINES + 5
    events = (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()
    assert len(events) == 1000  # metrics.jsonl still records every join


def test_the_live_table_shows_the_slowest_nodes_and_sums_up_the_rest(tmp_path: Path) -> None:
    monitor = Monitor(tmp_path / "run", live=False)
    try:
        for i in range(1000):
            monitor.nodes[f"{i:064x}"] = NodeView(
                f"n{i}", "cpu", samples_per_s=1000.0 - i, samples=10, bytes_sent=2**20
            )
        screen = Console(file=io.StringIO(), width=200, force_terminal=True, color_system=None)
        screen.print(monitor)  # (what the live view draws, 4 times a second)
    finally:
        monitor.close()
    rows = [line for line in screen.file.getvalue().splitlines() if " cpu " in line]
    assert len(rows) == TABLE_ROWS
    assert [r.split()[1] for r in rows] == [f"n{999 - k}" for k in range(TABLE_ROWS)]  # slowest first
    rest, text = 1000 - TABLE_ROWS, " ".join(screen.file.getvalue().split())  # (the caption wraps)
    assert f"{rest} faster nodes not shown" in text
    assert f"{10 * rest} samples, {rest:.1f} MiB sent" in text


def test_the_live_table_shows_the_figures_of_when_it_is_drawn_not_of_the_last_event(tmp_path: Path) -> None:
    """The terminal redraws the table on its own clock; an event does not build one (at a thousand
    nodes that was most of a second of the coordinator's CPU a round: benchmarks/bench_monitor.py)."""
    monitor = Monitor(tmp_path / "run", live=False)
    screen = Console(file=io.StringIO(), width=200, force_terminal=True, color_system=None)
    try:
        monitor.nodes["a" * 64] = NodeView("n0", "cpu", samples=10)
        monitor.event("progress", node_id="a" * 64, round=1, unit=[0, 1, 0, 10], loss=1.0, samples_per_s=5.0)
        monitor.nodes["a" * 64].samples = 4321  # (the coordinator updates its view between events)
        screen.print(monitor)
    finally:
        monitor.close()
    [row] = [line.split() for line in screen.file.getvalue().splitlines() if " cpu " in line]
    assert row[1] == "n0" and "4321" in row
