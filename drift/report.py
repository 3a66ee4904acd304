"""`drift report RUN_DIR...`: PNG plots and a summary from the metrics.jsonl of one or more runs.

    loss.png         validation loss against samples trained and against wall-clock
    nodes.png        per node and round: time training, waiting at the barrier, in the all-reduce
    bytes.png        bytes each node sent per round
    utilization.png  the fraction of each node's wall-clock spent in inner steps: per round, and
                     over the whole run per node (from the rounds' per-node `step_s`)
    metrics.png      the task's own metrics (its metrics(model, batch): accuracy, ...) against
                     samples trained, one panel each; only when the task defines some

Several run directories overlay in one set of plots (each labelled by its directory name), which
is how benchmarks/bench_vs_ddp.py compares drift with synchronous data-parallel training. Any run
that writes the same events can be plotted: see `Run` for the fields read.
"""

from __future__ import annotations

import itertools
import json
from dataclasses import dataclass, field
from pathlib import Path

from drift.monitor import attach_rows


class ReportError(ValueError):
    """A run directory that cannot be reported on; the message names it and what is wrong."""


@dataclass
class Run:
    """The parts of one run's metrics.jsonl that the report uses.

    Wall-clock is measured from the moment training starts (`training_started`: every node has
    joined and calibrated), so start-up (imports, joining, calibration) is not on the time axis;
    `startup_s` keeps it. θ0's val loss (`initial`, which drift's nodes report along with round 0)
    is plotted at time 0.
    """

    label: str
    initial_val: float | None = None
    initial_metrics: dict = field(default_factory=dict)  # the task's metrics of θ0
    startup_s: float = 0.0
    rounds: list[dict] = field(default_factory=list)  # `round` events by round number, the last of each kept
    wall_s: float | None = None  # to the `complete` event, when there is one
    complete: dict = field(default_factory=dict)  # the `complete` event's own fields
    skipped: list[str] = field(default_factory=list)  # lines that are not events (a torn write, say)

    def val_curve(self) -> list[tuple[int, float, float]]:
        """(samples trained, seconds since training started, val loss) at θ0 and after each round."""
        pts = [(0, 0.0, self.initial_val)] if self.initial_val is not None else []
        samples = 0
        for r in self.rounds:
            samples += r["samples"]
            if r.get("val_loss") is not None:
                pts.append((samples, r["t"], r["val_loss"]))
        return pts

    def metric_curves(self) -> dict[str, list[tuple[int, float]]]:
        """{metric: [(samples trained, value)]} at θ0 and after each round that has it."""
        curves: dict[str, list[tuple[int, float]]] = {}
        for k, v in self.initial_metrics.items():
            curves.setdefault(k, []).append((0, v))
        samples = 0
        for r in self.rounds:
            samples += r["samples"]
            for k, v in (r.get("metrics") or {}).items():
                curves.setdefault(k, []).append((samples, v))
        return curves

    def final_val(self) -> float | None:
        curve = self.val_curve()
        return curve[-1][2] if curve else None

    def mib_per_node(self) -> float:
        """MiB sent over the whole run, averaged over the nodes."""
        per_node = self.bytes_per_node()
        return sum(per_node.values()) / max(1, len(per_node)) / 2**20

    def bytes_per_node(self) -> dict[str, int]:
        """Bytes each node sent over the whole run (as the nodes counted them)."""
        out: dict[str, int] = {}
        for r in self.rounds:
            for name, n in r.get("nodes", {}).items():
                out[name] = out.get(name, 0) + int(n.get("bytes_sent", 0))
        return out

    def utilization(self) -> dict[str, float]:
        """Per node: seconds in inner steps (the rounds' `step_s`) over the run's wall-clock from
        training start to its last round. Nodes whose rounds carry no `step_s` are left out."""
        wall = self.rounds[-1]["t"] if self.rounds else 0.0
        steps: dict[str, float] = {}
        for r in self.rounds:
            for name, n in r.get("nodes", {}).items():
                if n.get("step_s") is not None:
                    steps[name] = steps.get(name, 0.0) + float(n["step_s"])
        return {name: s / wall for name, s in steps.items()} if wall > 0 else {}

    def round_utilization(self) -> list[tuple[int, dict[str, float]]]:
        """(round, {node: step_s / the round's wall-clock}), a round's wall-clock being the time
        since the previous round event (since training start for the first)."""
        out, prev = [], 0.0
        for r in self.rounds:
            span, prev = r["t"] - prev, r["t"]
            if span > 0:
                nodes = r.get("nodes", {}).items()
                out.append(
                    (r["round"], {k: float(n["step_s"]) / span for k, n in nodes if n.get("step_s") is not None})
                )
        return out

    def time_to(self, target: float) -> float | None:
        """Seconds (since training started) until val loss first reached `target`, interpolated
        linearly between evaluations; None if it never did."""
        curve = self.val_curve()
        if curve and curve[0][2] <= target:
            return curve[0][1]
        for (_, t0, v0), (_, t1, v1) in itertools.pairwise(curve):
            if v1 <= target:  # and v0 > target, or the previous pair would have returned
                return t0 + (t1 - t0) * (v0 - target) / (v0 - v1)
        return None


def load_run(run_dir: Path, label: str | None = None) -> Run:
    """Read RUN_DIR/metrics.jsonl. A torn last line (a run still writing) is ignored; any other
    line that is not an event (a write torn by kill -9 before a --resume) is skipped and named in
    `Run.skipped`."""
    path = Path(run_dir) / "metrics.jsonl"
    if not path.is_file():
        raise ReportError(f"{run_dir}: no metrics.jsonl here (give the run directory `drift coord` printed)")
    run = Run(label or Path(run_dir).resolve().name)
    lines = path.read_text().splitlines()
    by_round: dict[int, dict] = {}
    offset = last_t = 0.0
    started: float | None = None  # `training_started`
    first: float | None = None  # the first `initial` or `round`: training was under way by then
    last_joined = 0.0
    for no, line in enumerate(lines, 1):
        try:
            e = json.loads(line)
            kind, t = e["event"], float(e["t"])
        except (ValueError, KeyError, TypeError, RecursionError):
            if no != len(lines):
                run.skipped.append(f"{path}:{no}: not a metrics event, skipped: {line[:60]!r}")
            continue
        if t < last_t:  # a resumed coordinator starts its clock again: keep time running on
            offset += last_t
        last_t = t
        t += offset
        if kind in ("initial", "round") and first is None:
            first = t
        if kind == "training_started" and started is None:
            started = t
        elif kind == "node_joined" and first is None:
            last_joined = t  # runs written before `training_started` existed: the last join is the start
        elif kind == "initial" and run.initial_val is None:
            run.initial_val = e.get("val_loss")
            run.initial_metrics = e.get("metrics") or {}
        elif kind == "round":
            try:
                by_round[int(e["round"])] = {**e, "t": t, "samples": int(e["samples"])}
            except (KeyError, TypeError, ValueError):
                raise ReportError(f"{path}:{no}: round event without round/samples") from None
        elif kind == "complete":
            run.wall_s = t
            run.complete = {k: v for k, v in e.items() if k not in ("t", "event")}
    run.startup_s = started if started is not None else (last_joined or first or 0.0)
    run.rounds = [{**by_round[k], "t": by_round[k]["t"] - run.startup_s} for k in sorted(by_round)]
    if not run.rounds:
        raise ReportError(f"{path}: no finished round yet, nothing to plot")
    try:  # rounds of many members keep their slowest rows in metrics.jsonl, all of them in nodes.jsonl
        attach_rows(Path(run_dir), run.rounds)
    except OSError as e:
        raise ReportError(f"{run_dir}: its rounds' rows cannot be read (nodes.jsonl: {e.strerror})") from None
    except ValueError as e:
        raise ReportError(str(e)) from None
    return run


def summary(runs: list[Run]) -> str:
    """A plain-text table: final val loss, training wall-clock, MiB sent per node, utilization
    (the least and the most of the nodes', in %)."""
    rows = [f"{'run':<16} {'rounds':>6} {'samples':>9} {'val loss':>9} {'train s':>8} {'MiB/node':>9} {'util %':>9}"]
    for r in runs:
        mib = r.mib_per_node()
        samples = sum(x["samples"] for x in r.rounds)
        fv = r.final_val()
        u = r.utilization().values()
        util = f"{100 * min(u):.0f}-{100 * max(u):.0f}" if u else "-"
        rows.append(
            f"{r.label:<16} {len(r.rounds):>6} {samples:>9} {fv if fv is not None else float('nan'):>9.4f} "
            f"{r.rounds[-1]['t']:>8.1f} {mib:>9.2f} {util:>9}"
        )
    return "\n".join(rows)


def write_report(runs: list[Run], out: Path) -> list[Path]:
    """Draw loss.png, nodes.png, bytes.png, utilization.png (and metrics.png) into `out`; returns their paths."""
    import matplotlib

    matplotlib.use("Agg")  # files only: no display needed (or wanted) on a headless node
    import matplotlib.pyplot as plt
    from matplotlib.ticker import MaxNLocator

    # Node names and run labels come from the network and the command line: plain text, never
    # mathtext (a name like `$\\evil$` is otherwise parsed as math, and fails the plot).
    matplotlib.rcParams["text.parse_math"] = False
    out.mkdir(parents=True, exist_ok=True)
    written = []

    fig, (by_samples, by_time) = plt.subplots(1, 2, figsize=(11, 4.2))
    for r in runs:
        curve = r.val_curve()
        if curve:
            s, t, v = zip(*curve)
            by_samples.plot(s, v, marker=".", label=r.label)
            by_time.plot(t, v, marker=".", label=r.label)
    by_samples.set(xlabel="samples trained", ylabel="validation loss", title="val loss vs samples")
    by_time.set(
        xlabel="wall-clock since training started (s)", ylabel="validation loss", title="val loss vs wall-clock"
    )
    for ax in (by_samples, by_time):
        ax.grid(alpha=0.3)
        ax.legend()
    written.append(_save(fig, out / "loss.png"))

    fig, axes = plt.subplots(len(runs), 1, figsize=(11, 2.6 * len(runs)), squeeze=False)
    for ax, r in zip(axes[:, 0], runs):
        names = sorted({n for x in r.rounds for n in x.get("nodes", {})})
        width = 0.8 / max(1, len(names))
        for k, name in enumerate(names):
            xs, busy, idle, sync = [], [], [], []
            for x in r.rounds:
                n = x.get("nodes", {}).get(name)
                if n is None:
                    continue
                xs.append(x["round"] + (k - (len(names) - 1) / 2) * width)
                idle.append(n.get("idle_s", 0.0))
                sync.append(n.get("sync_s", 0.0))
                busy.append(n.get("busy_s", max(0.0, x.get("seconds", 0.0) - idle[-1] - sync[-1])))
            lab = k == 0
            ax.bar(xs, busy, width, color="tab:blue", label="training" if lab else None)
            ax.bar(xs, idle, width, bottom=busy, color="tab:orange", label="waiting at barrier" if lab else None)
            ax.bar(
                xs,
                sync,
                width,
                bottom=[b + i for b, i in zip(busy, idle)],
                color="tab:green",
                label="all-reduce" if lab else None,
            )
        ax.set(ylabel="seconds", title=f"{r.label}: per node ({', '.join(names)}) and round")
        ax.legend(loc="upper right", fontsize="small")
    axes[-1, 0].set_xlabel("round")
    for ax in axes[:, 0]:
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    written.append(_save(fig, out / "nodes.png"))

    written.append(_save(bytes_figure(runs), out / "bytes.png"))
    written.append(_utilization_plot(runs, out / "utilization.png"))
    names = sorted({k for r in runs for k in r.metric_curves()})
    if names:
        fig, axes = plt.subplots(1, len(names), figsize=(5.5 * len(names), 4.2), squeeze=False)
        for ax, name in zip(axes[0], names):
            for r in runs:
                if pts := r.metric_curves().get(name):
                    s, v = zip(*pts)
                    ax.plot(s, v, marker=".", label=r.label)
            ax.set(xlabel="samples trained", ylabel=name, title=f"val {name}")
            ax.grid(alpha=0.3)
            ax.legend()
        written.append(_save(fig, out / "metrics.png"))
    return written


def bytes_figure(runs: list[Run]):
    """bytes.png: MiB each node sent per round, on a log axis labelled in plain numbers."""
    import matplotlib

    matplotlib.use("Agg")
    matplotlib.rcParams["text.parse_math"] = False  # as write_report: names are text, not math
    import matplotlib.pyplot as plt
    from matplotlib.ticker import FuncFormatter, NullFormatter

    fig, ax = plt.subplots(figsize=(8, 4))
    for r in runs:
        names = sorted({n for x in r.rounds for n in x.get("nodes", {})})
        for name in names if len(runs) == 1 else [None]:
            pts = [(x["round"], _mib(x, name)) for x in r.rounds]
            if not any(mib for _, mib in pts):
                continue  # sent nothing (a single node): nothing to draw on a log axis
            ax.plot(*zip(*pts), marker=".", label=name if len(runs) == 1 else f"{r.label} (mean per node)")
    ax.set(xlabel="round", ylabel="MiB sent", yscale="log", title="bytes sent per node and round")
    ax.grid(alpha=0.3, which="both")
    if ax.lines:
        ax.legend(fontsize="small")
    else:
        ax.text(0.5, 0.5, "no node sent anything", transform=ax.transAxes, ha="center")
    # text.parse_math is off (node names are not math), so the log axis's default "$10^{-1}$"
    # labels would show raw: plain numbers instead
    ax.yaxis.set_major_formatter(FuncFormatter(lambda v, _: f"{v:g}"))
    ax.yaxis.set_minor_formatter(NullFormatter())
    return fig


def _utilization_plot(runs: list[Run], path: Path) -> Path:
    """Per round (left: each run's mean over its nodes, the band spanning its nodes) and over the
    whole run per node (right): the fraction of wall-clock spent in inner steps."""
    import matplotlib.pyplot as plt

    fig, (per_round, overall) = plt.subplots(1, 2, figsize=(11, 4.2), gridspec_kw={"width_ratios": [3, 2]})
    labels, bars = [], []
    for k, r in enumerate(runs):
        color = f"C{k}"
        pts = [(rnd, list(u.values())) for rnd, u in r.round_utilization() if u]
        if pts:
            xs = [x for x, _ in pts]
            per_round.plot(xs, [100 * sum(v) / len(v) for _, v in pts], marker=".", color=color, label=r.label)
            per_round.fill_between(
                xs, [100 * min(v) for _, v in pts], [100 * max(v) for _, v in pts], color=color, alpha=0.2, linewidth=0
            )
        for name, u in sorted(r.utilization().items()):
            labels.append(f"{r.label}\n{name}" if len(runs) > 1 else name)
            bars.append((100 * u, color))
    # An overlapped round settles while the next one trains, so the span between two round events
    # can be shorter than a round's training: single rounds may show over 100 %; the run's total cannot.
    top = max([105.0] + [100 * max(u.values()) + 5 for r in runs for _, u in r.round_utilization() if u])
    per_round.set(
        xlabel="round", ylabel="% of wall-clock in inner steps", title="utilization per round", ylim=(0, min(top, 200))
    )
    per_round.grid(alpha=0.3)
    if per_round.lines:
        per_round.legend(fontsize="small", loc="lower right")
    ys = range(len(bars))
    overall.barh(list(ys), [b for b, _ in bars], color=[c for _, c in bars])
    for y, (b, _) in zip(ys, bars):
        overall.text(min(b, 100) + 1, y, f"{b:.1f} %", va="center", fontsize="small")
    overall.set(
        yticks=list(ys),
        xlim=(0, 118),
        xlabel="% of wall-clock in inner steps",
        title="utilization over the run, per node",
    )
    overall.set_yticklabels(labels, fontsize="small")
    overall.invert_yaxis()
    overall.grid(alpha=0.3, axis="x")
    if not bars:
        overall.text(0.5, 0.5, "no step_s in these runs", transform=overall.transAxes, ha="center")
    return _save(fig, path)


def _mib(round_event: dict, name: str | None) -> float:
    nodes = round_event.get("nodes", {})
    if name is not None:
        return nodes.get(name, {}).get("bytes_sent", 0) / 2**20
    return sum(n.get("bytes_sent", 0) for n in nodes.values()) / max(1, len(nodes)) / 2**20


def _save(fig, path: Path) -> Path:
    """Write atomically: a reader never sees half a PNG."""
    import matplotlib.pyplot as plt

    fig.tight_layout()
    tmp = path.with_name(f".{path.name}.tmp")
    fig.savefig(tmp, dpi=110, format="png")
    plt.close(fig)
    tmp.replace(path)
    return path
