"""The coordinator's view stays readable with a thousand nodes (issue 40): its terminal names the
first nodes that join and then counts them, the live table shows the slowest nodes and sums up the
rest, and metrics.jsonl's round event keeps the slowest members' rows and a summary (every row in
nodes.jsonl), instead of a line or a row per node."""

from __future__ import annotations

import io
import json
from pathlib import Path

import pytest
from rich.console import Console

from drift.monitor import JOIN_LINES, ROUND_ROWS, TABLE_ROWS, Monitor, NodeView, read_events, scalars
from drift.report import ReportError, load_run
from drift.status import NAMES, run_status


def _joins(run: Path, names: list[str]) -> None:
    """What the coordinator records as these nodes join, in `run`."""
    monitor = Monitor(run, live=False)
    try:
        for i, name in enumerate(names):
            monitor.event("node_joined", node_id=f"{i:064x}", name=name, device="cpu")
    finally:
        monitor.close()


def test_a_thousand_joins_are_a_few_lines(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    _joins(tmp_path / "run", [f"n{i}" for i in range(1000)])
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


def _rows(n: int) -> dict[str, dict]:
    """A round's node rows as drift.round writes them: n{i} reached the barrier after i ms, every
    tenth evaluated (no samples, no weight)."""
    return {
        f"n{i}": {
            "node_id": f"{i:064x}",
            "samples": 0 if i % 10 == 0 else 16,
            "steps": 0 if i % 10 == 0 else 2,
            "weight": 0.0 if i % 10 == 0 else 1 / n,
            "busy_s": i / 1000,
            "step_s": 0.5,
            "idle_s": (n - i) / 1000,
            "sync_s": 2.0,
            "check_s": 0.01,
            "bytes_sent": 1000 + i,
            "units_after_stop": 0,
            "role": "evaluate" if i % 10 == 0 else "train",
            "trained": [] if i % 10 == 0 else [[0, i, 0, 16]],
        }
        for i in range(n)
    }


def _round(rnd: int, rows: dict[str, dict]) -> dict:
    """A round event's fields as drift.round notes them."""
    return dict(
        round=rnd,
        epoch=0,
        val_loss=2.0,
        train_loss=2.1,
        samples=sum(r["samples"] for r in rows.values()),
        seconds=10.0,
        reduce_s=2.0,
        bytes_sent=sum(r["bytes_sent"] for r in rows.values()),
        nodes=rows,
    )


def test_a_round_of_a_thousand_members_is_a_short_line_and_loses_no_row(tmp_path: Path) -> None:
    """metrics.jsonl's round event keeps the rows of the ROUND_ROWS members last at the barrier and
    a summary of all; nodes.jsonl has every row, and read_events(whole=True) puts them back."""
    run, rows = tmp_path / "run", _rows(1000)
    monitor = Monitor(run, live=False)
    try:
        monitor.event("round", **_round(0, rows))
        monitor.event("round", **_round(1, rows))
    finally:
        monitor.close()
    lines = (run / "metrics.jsonl").read_text().splitlines()
    assert len(lines) == 2 and max(map(len, lines)) < 12_000  # (the whole rows: ~290 KB)
    cut = read_events(run)
    assert list(cut[1]["nodes"]) == [f"n{999 - k}" for k in range(ROUND_ROWS)]  # the last to the barrier
    assert cut[1]["nodes"]["n999"] == rows["n999"]
    assert cut[1]["summary"] == {
        "members": 1000,
        "train": 900,
        "evaluate": 100,
        "counted": 900,
        "samples": 900 * 16,
        "steps": 900 * 2,
        "bytes_sent": sum(1000 + i for i in range(1000)),
        "units_after_stop": 0,
        "busy_s": {"min": 0.0, "median": 0.5, "max": 0.999},
        "step_s": {"min": 0.5, "median": 0.5, "max": 0.5},
        "idle_s": {"min": 0.001, "median": 0.501, "max": 1.0},
        "sync_s": {"min": 2.0, "median": 2.0, "max": 2.0},
        "check_s": {"min": 0.01, "median": 0.01, "max": 0.01},
    }
    whole = read_events(run, whole=True)
    assert [e["nodes"] for e in whole] == [rows, rows]
    assert len((run / "nodes.jsonl").read_text().splitlines()) == 2


def test_a_round_of_few_members_keeps_every_row_in_metrics(tmp_path: Path) -> None:
    run, rows = tmp_path / "run", _rows(ROUND_ROWS)
    monitor = Monitor(run, live=False)
    try:
        monitor.event("round", **_round(0, rows))
    finally:
        monitor.close()
    (event,) = read_events(run)
    assert event["nodes"] == rows and "summary" not in event
    assert not (run / "nodes.jsonl").exists()


def test_the_report_counts_every_member_of_a_cut_round_and_says_when_their_rows_are_gone(tmp_path: Path) -> None:
    run, rows = tmp_path / "run", _rows(1000)
    monitor = Monitor(run, live=False)
    try:
        monitor.event("training_started", nodes=1000)
        monitor.event("round", **_round(0, rows))
    finally:
        monitor.close()
    assert load_run(run).bytes_per_node() == {k: r["bytes_sent"] for k, r in rows.items()}
    (run / "nodes.jsonl").write_text("")
    with pytest.raises(ReportError, match=r"nodes.jsonl: no rows of round 0 at byte 0$"):
        load_run(run)


def test_a_thousand_nodes_chart_three_utilization_lines(tmp_path: Path) -> None:
    ((_, few),), ((_, many),) = (scalars({"event": "round", **_round(0, _rows(n))}) for n in (16, 1000))
    assert sorted(k for k in few if k.startswith("utilization/")) == sorted(f"utilization/n{i}" for i in range(16))
    assert sorted(k for k in many if k.startswith("utilization/")) == [
        "utilization/max",
        "utilization/median",
        "utilization/min",
    ]


def test_status_names_sixteen_nodes_and_counts_the_rest(tmp_path: Path) -> None:
    _joins(tmp_path / "run", [f"n{i:03}" for i in range(1000)])
    (line,) = [x for x in run_status(tmp_path / "run") if x.startswith("nodes ")]
    assert line == "nodes 1000 (" + ", ".join(f"n{i:03}" for i in range(NAMES)) + f", +{1000 - NAMES} more)"


@pytest.mark.parametrize("members", [ROUND_ROWS, 1000])
def test_a_large_swarms_unit_progress_goes_to_nodes_jsonl_and_still_moves_the_bar(tmp_path: Path, members: int) -> None:
    """A thousand members report a thousand units a round: above ROUND_ROWS members their progress
    events are lines of nodes.jsonl, not metrics.jsonl; the live view counts them either way."""
    run = tmp_path / "run"
    monitor = Monitor(run, live=False)
    try:
        for k in range(members):
            monitor.nodes[f"{k:064x}"] = NodeView(f"n{k}", "cpu")
        monitor.round_samples = 64
        monitor.event("progress", node_id=f"{0:064x}", round=0, unit=[0, 7, 0, 16], loss=1.0, samples_per_s=5.0)
        screen = Console(file=io.StringIO(), width=200, force_terminal=True, color_system=None)
        screen.print(monitor)  # (what the live view draws)
    finally:
        monitor.close()
    in_metrics = [e for e in read_events(run) if e["event"] == "progress"]
    detail = run / "nodes.jsonl"
    in_nodes = [json.loads(x) for x in detail.read_text().splitlines()] if detail.exists() else []
    assert (len(in_metrics), len(in_nodes)) == ((1, 0) if members <= ROUND_ROWS else (0, 1))
    assert [e["unit"] for e in in_metrics + in_nodes] == [[0, 7, 0, 16]]
    assert "[#####...............] 25%" in screen.file.getvalue()  # 16 of the round's 64 samples
