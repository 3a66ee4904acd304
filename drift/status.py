"""`drift status RUN_DIR`: how a run stands, from its metrics.jsonl (live or finished): the round,
the nodes in the swarm, the losses and the ETA."""

from __future__ import annotations

import json
import time
from pathlib import Path

from drift.monitor import Eta, _duration

NAMES = 16  # nodes named on the `nodes` line; the others counted (a thousand names are no status)


class StatusError(Exception):
    """Why a run directory says nothing; one line for the user."""


def run_status(run_dir: Path) -> list[str]:
    """The lines `drift status RUN_DIR` prints."""
    path = Path(run_dir) / "metrics.jsonl"
    try:
        text = path.read_text()
        age = time.time() - path.stat().st_mtime
    except OSError as e:
        raise StatusError(f"{run_dir}: not a run directory ({path}: {e.strerror or e})") from None
    eta, nodes, rounds = Eta(), {}, None
    last_round = initial = complete = None
    t = 0.0
    for line in text.splitlines():
        try:
            rec = json.loads(line)
            kind, t = rec["event"], float(rec["t"])
        except (ValueError, KeyError, TypeError):
            continue  # a line cut short by a crash: the rest still tells
        eta.event(rec)
        if kind == "run":
            rounds = rec.get("rounds", rounds)
        elif kind == "node_joined":
            nodes[rec["node_id"]] = rec.get("name", "?")
        elif kind == "node_left":
            nodes.pop(rec.get("node_id"), None)
        elif kind == "round":
            last_round = rec
        elif kind == "initial":
            initial = rec
        elif kind == "complete":
            complete, rounds = rec, rec.get("rounds", rounds)
    of = f"/{rounds}" if rounds else ""
    if complete is not None:
        state, nodes = "finished", {}
    elif last_round is None:
        state = "starting" if initial is None else f"training round 1{of}"
    else:
        state = f"training round {last_round['round'] + 2}{of}"  # rounds count from 1 here
    lines = [f"{run_dir}: {state}  (last event {_duration(age)} ago)"]
    if last_round is not None:
        tl, vl = last_round.get("train_loss"), last_round.get("val_loss")
        lines.append(
            f"round {last_round['round'] + 1}{of} done  train loss {'-' if tl is None else f'{tl:.4f}'}  "
            f"val loss {'-' if vl is None else f'{vl:.4f}'}  samples {last_round.get('samples', '-')}"
        )
    elif initial is not None and initial.get("val_loss") is not None:
        lines.append(f"initial val loss {initial['val_loss']:.4f}")
    if complete is not None:
        vl = complete.get("final_val_loss")
        lines.append(f"run complete: {complete.get('rounds')} rounds" + (f", final val loss {vl:.4f}" if vl else ""))
    else:
        names = sorted(nodes.values())
        shown = ", ".join(names[:NAMES]) + (f", +{len(names) - NAMES} more" if len(names) > NAMES else "")
        lines.append(f"nodes {len(nodes)}" + (f" ({shown})" if names else ""))
        if rounds:
            lines.append(f"ETA {_duration(eta.seconds_left(rounds, t + age))}")
    return lines
