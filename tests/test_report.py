"""`drift report`: what it reads from metrics.jsonl, the figures it derives, and its errors.

The end-to-end test (test_e2e.py) runs it on a real swarm's run; here the files are written by
hand to pin down the edge cases: a torn last line, a resumed run, a broken line, no rounds.
"""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest
from conftest import drift_cmd

from drift.report import ReportError, bytes_figure, load_run, write_report


def _write(run_dir: Path, events: list[dict], tail: str = "") -> Path:
    run_dir.mkdir(parents=True, exist_ok=True)
    (run_dir / "metrics.jsonl").write_text("".join(json.dumps(e) + "\n" for e in events) + tail)
    return run_dir


def _round(rnd: int, t: float, val: float, samples: int = 100, **nodes: int) -> dict:
    return {
        "t": t,
        "event": "round",
        "round": rnd,
        "val_loss": val,
        "samples": samples,
        "seconds": 1.0,
        "nodes": {
            name: {
                "samples": samples // max(1, len(nodes)),
                "busy_s": 0.8,
                "idle_s": 0.1,
                "sync_s": 0.1,
                "bytes_sent": b,
            }
            for name, b in nodes.items()
        },
    }


# As drift writes them: θ0's val loss comes in with round 0, after training started.
EVENTS = [
    {"t": 0.5, "event": "node_joined", "name": "a"},
    {"t": 10.0, "event": "training_started", "nodes": 2},
    {"t": 11.9, "event": "initial", "val_loss": 4.0},
    _round(0, 12.0, 3.0, a=1000, b=3000),
    _round(1, 14.0, 2.0, a=1000, b=3000),
    {"t": 15.0, "event": "complete", "rounds": 2},
]


def test_curve_starts_at_training_and_counts_samples(tmp_path: Path) -> None:
    run = load_run(_write(tmp_path / "mine", EVENTS))
    assert run.label == "mine" and run.startup_s == 10.0 and run.wall_s == 15.0
    assert run.val_curve() == [(0, 0.0, 4.0), (100, 2.0, 3.0), (200, 4.0, 2.0)]
    assert run.final_val() == 2.0
    assert run.bytes_per_node() == {"a": 2000, "b": 6000}


@pytest.mark.swarm
def test_runs_from_before_training_started_start_at_the_last_join(tmp_path: Path) -> None:
    old = [e for e in EVENTS if e["event"] != "training_started"]
    old.insert(1, {"t": 9.0, "event": "node_joined", "name": "b"})
    run = load_run(_write(tmp_path / "old", old))
    assert run.startup_s == 9.0 and run.val_curve()[1] == (100, 3.0, 3.0)


def test_time_to_target_interpolates_between_evaluations(tmp_path: Path) -> None:
    run = load_run(_write(tmp_path / "r", EVENTS))
    assert run.time_to(3.5) == pytest.approx(1.0)  # halfway from 4.0 (t=0) to 3.0 (t=2)
    assert run.time_to(2.0) == pytest.approx(4.0)
    assert run.time_to(4.0) == 0.0  # θ0 is already there
    assert run.time_to(1.9) is None  # never reached


def test_a_torn_last_line_is_a_run_still_writing(tmp_path: Path) -> None:
    run = load_run(_write(tmp_path / "r", EVENTS[:5], tail='{"t": 16.0, "event": "rou'))
    assert [r["round"] for r in run.rounds] == [0, 1]


def test_a_resumed_run_keeps_time_running_and_the_redone_round(tmp_path: Path) -> None:
    # The coordinator died after round 1 and resumed from the checkpoint of round 0: its clock
    # restarts at 0 and round 1 is trained again. The report keeps the second round 1.
    events = [*EVENTS[:5], {"t": 1.0, "event": "resumed", "round": 0}, _round(1, 5.0, 1.5, a=1000, b=3000)]
    run = load_run(_write(tmp_path / "r", events))
    assert [r["val_loss"] for r in run.rounds] == [3.0, 1.5]
    assert run.rounds[-1]["t"] == pytest.approx(14.0 + 5.0 - 10.0)


@pytest.mark.swarm
@pytest.mark.parametrize(
    "content,needle",
    [
        (None, "no metrics.jsonl here"),
        ('{"t": 1, "event": "initial", "val_loss": 4}\n', "no finished round yet"),
        ('{"t": 1, "event": "round", "round": 0}\n{"t": 2, "event": "x"}\n', "metrics.jsonl:1: round event without"),
    ],
)
def test_bad_run_dirs_are_one_line_errors(tmp_path: Path, content: str | None, needle: str) -> None:
    run_dir = tmp_path / "r"
    run_dir.mkdir()
    if content is not None:
        (run_dir / "metrics.jsonl").write_text(content)
    with pytest.raises(ReportError, match=needle):
        load_run(run_dir)
    out = subprocess.run(drift_cmd("report", str(run_dir)), capture_output=True, text=True, timeout=60)
    lines = out.stderr.strip().splitlines()
    assert out.returncode != 0 and len(lines) == 1 and lines[0].startswith("drift: error: ") and needle in lines[0]
    assert not list(run_dir.glob("*.png"))  # nothing half-written


@pytest.mark.swarm
def test_a_torn_line_in_the_middle_is_skipped_with_a_warning(tmp_path: Path) -> None:
    # kill -9 tore the last line, then --resume appended to it: the line is skipped, not fatal.
    run_dir = tmp_path / "r"
    _write(
        run_dir,
        EVENTS[:4],
        tail='{"t": 12.5, "event": "rou' + json.dumps(EVENTS[4]) + "\n" + json.dumps(EVENTS[5]) + "\n",
    )
    out = subprocess.run(drift_cmd("report", str(run_dir)), capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    warnings = out.stderr.strip().splitlines()
    assert len(warnings) == 1 and warnings[0].startswith("drift: warning: ") and "metrics.jsonl:5" in warnings[0]
    assert (run_dir / "loss.png").is_file() and [r["round"] for r in load_run(run_dir).rounds] == [0]


@pytest.mark.swarm
def test_node_names_are_plain_text_in_plots(tmp_path: Path) -> None:
    # Names come from the network (`drift join --name`): `$\evil$` is no mathtext to matplotlib.
    events = [
        *EVENTS[:3],
        _round(0, 12.0, 3.0, **{"$\\evil$": 1000, "$x^": 5}),
        _round(1, 14.0, 2.0, **{"$\\evil$": 9}),
    ]
    run_dir = _write(tmp_path / "r", events)
    out = subprocess.run(drift_cmd("report", str(run_dir)), capture_output=True, text=True, timeout=120)
    assert out.returncode == 0 and "Traceback" not in out.stderr, out.stderr
    assert {p.name for p in run_dir.glob("*.png")} == {"loss.png", "nodes.png", "bytes.png", "utilization.png"}


def test_several_runs_overlay_in_one_set_of_plots(tmp_path: Path) -> None:
    runs = [load_run(_write(tmp_path / name, EVENTS)) for name in ("ddp", "drift")]
    paths = write_report(runs, tmp_path / "out")
    assert sorted(p.name for p in paths) == ["bytes.png", "loss.png", "nodes.png", "utilization.png"]
    assert all(p.read_bytes()[:4] == b"\x89PNG" for p in paths)
    assert not list((tmp_path / "out").glob(".*.tmp"))  # written atomically: no temp file left


@pytest.mark.swarm
def test_utilization_is_time_in_inner_steps_over_wall_clock(tmp_path: Path) -> None:
    # Two rounds ending 3 s and 9 s after training started; node a computed 2.7 s + 5.4 s of them,
    # b only 1.5 s + 3.0 s (it waited on the network); c is an evaluator with no inner steps.
    def rnd(r: int, t: float, a: float, b: float) -> dict:
        e = _round(r, 10.0 + t, 3.0 - r, a=10, b=10)
        e["nodes"]["a"].update(step_s=a, steps=30 * (r + 1))
        e["nodes"]["b"].update(step_s=b, steps=10)
        e["nodes"]["c"] = {"samples": 0, "busy_s": 0.0, "idle_s": 0.0, "sync_s": 0.0, "bytes_sent": 0}
        return e

    events = [
        *EVENTS[:3],
        rnd(0, 3.0, 2.7, 1.5),
        rnd(1, 9.0, 5.4, 3.0),
        {"t": 19.5, "event": "complete", "rounds": 2, "pure_compute_s": 0.09},
    ]
    run = load_run(_write(tmp_path / "r", events))
    assert run.utilization() == pytest.approx({"a": 8.1 / 9.0, "b": 4.5 / 9.0})
    assert [(k, pytest.approx(u)) for k, u in run.round_utilization()] == [
        (0, {"a": 0.9, "b": 0.5}),
        (1, {"a": 0.9, "b": 0.5}),
    ]
    assert run.complete == {"rounds": 2, "pure_compute_s": 0.09}
    # the summary shows the least and the most of the nodes' utilization; the plot is drawn
    out = subprocess.run(
        drift_cmd("report", str(tmp_path / "r"), "--out", str(tmp_path / "out")),
        capture_output=True,
        text=True,
        timeout=60,
    )
    row = next(line for line in out.stdout.splitlines() if line.startswith("r "))
    assert out.returncode == 0 and row.split()[-1] == "50-90"
    assert (tmp_path / "out" / "utilization.png").read_bytes()[:4] == b"\x89PNG"


def test_runs_without_step_s_have_no_utilization(tmp_path: Path) -> None:
    run = load_run(_write(tmp_path / "old", EVENTS))  # rounds written before step_s existed
    assert run.utilization() == {} and all(u == {} for _, u in run.round_utilization())
    assert (write_report([run], tmp_path / "out")[-1]).name == "utilization.png"


def test_bytes_axis_is_labelled_in_plain_numbers(tmp_path: Path) -> None:
    # text.parse_math is off (names are text): the log axis must not show raw "$\\mathdefault{10^{-1}}$"
    events = [*EVENTS[:3], _round(0, 12.0, 3.0, a=100_000, b=3_000_000), _round(1, 14.0, 2.0, a=50_000, b=9_000_000)]
    fig = bytes_figure([load_run(_write(tmp_path / "r", events))])
    fig.canvas.draw()
    labels = [t.get_text() for t in fig.axes[0].get_yticklabels() if t.get_text()]
    assert labels and all("$" not in lb and "mathdefault" not in lb for lb in labels), labels
    assert {"0.1", "1"} <= set(labels), labels
