"""The headline: drift (DiLoCo) against synchronous data-parallel training, measured fairly.

    sudo flock /tmp/drift-cpu.lock python3 benchmarks/bench_vs_ddp.py [--links 100mbit,10mbit,100mbit+25ms,loopback] [--out DIR]

On the default Shakespeare task (recipes/shakespeare.yaml: its model, batch 32 x 64 tokens, AdamW
and outer optimizer) with 2 nodes, every method on the same samples and the same inner
learning-rate schedule (linear warmup over the first 5 % of the samples, cosine decay to lr/10,
computed from the samples the whole world trained, as drift's nodes do):
  single            one process trains all the samples alone (2 x the steps)
  plain-pair        the same plain loop as one process per node at once, each on its own core with
                    a node's share of the steps, no communication: plain torch's samples/s per
                    node under the load a swarm's nodes see (its loss is of half the samples)
  ddp               torch DistributedDataParallel over gloo: gradients all-reduced every step
  drift-blocking    2 real `drift join` processes over iroh, int8 pseudo-gradients, nodes wait for
                    the all-reduce and the outer step
  drift-overlapped  the same with `sync: overlapped`: nodes train round r+1 while round r reduces

Fair on 2 cores: every training process is pinned to a core of its own (`taskset -c`; node or
rank i on core i, the single node on core 0), 1 torch thread each, so compute is never shared
between the two workers. drift's coordinator, which trains nothing, is not pinned. Links
(benchmarks/netns.py, needs root): each node's upload and download limited by tc tbf, no route
out, deleted on exit; `RATE+Dms` adds D ms on every packet a namespace receives (user space:
this kernel has no netem), so the round trip between two nodes is 2 D. The single node needs no
network and runs once.

Per run: final val loss (and vs ddp), time to a shared target loss (the worst of the runs' final
losses, so every run reaches it), MiB sent per node (as the senders count payload, and the
interface's own counter, headers included), and utilization: each node's seconds in inner steps
over the wall-clock from training start to its last round (min-max over the nodes). The ideal
speed-up over ddp is ddp's measured wall-clock per step over its pure compute per step (the same
steps under no_sync(), both in ddp's own run): what removing all communication could gain at
best. `capture` = drift's speed-up to the target over that ideal. `drift report` draws each
link's plots (loss, nodes, bytes, utilization) into OUT/<link>/.
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import re
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import yaml

from drift.report import Run, load_run
from harness.simulate import Swarm, make_task_repo

ROOT = Path(__file__).resolve().parents[1]
MiB = 2**20
RUNS = ("single", "plain-pair", "ddp", "drift-blocking", "drift-overlapped")


def recipe(args: argparse.Namespace, sync: str = "blocking") -> dict:
    r = yaml.safe_load((ROOT / "recipes" / "shakespeare.yaml").read_text())
    r.pop("task")  # make_task_repo sets it
    total = args.rounds * args.inner_steps * args.nodes * r["batch_size"]
    r.update(
        name=f"vs-ddp-{sync}",
        min_nodes=args.nodes,
        codec=args.codec,
        rounds=args.rounds,
        inner_steps=args.inner_steps,
        sync=sync,
        checkpoint_every=args.rounds,  # one checkpoint, at the end
        lr_schedule={"warmup_samples": total // 20, "min_lr": r["inner_optimizer"]["lr"] / 10},
        network="local",
    )
    return r


def pin(core: int) -> list[str]:
    return ["taskset", "-c", str(core)]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_drift(work: Path, sync: str, args: argparse.Namespace, net=None) -> dict:
    work.mkdir(parents=True)
    rec = make_task_repo(work / "repo", recipe(args, sync))
    coord_args = ["--network", "lan"] if net else []
    t0 = time.time()
    swarm = Swarm(rec, work, *coord_args, wrap=net.exec_prefix(args.nodes) if net else None)
    for i in range(args.nodes):
        swarm.join(name=f"n{i}", wrap=[*(net.exec_prefix(i) if net else []), *pin(i % os.cpu_count())])
    rc = swarm.finish(timeout=3600)
    if rc != 0:
        raise SystemExit(f"drift-{sync} failed:\n{swarm.log()[-3000:]}")
    return {"run_dir": swarm.run_dir, "total_s": time.time() - t0}


def run_baseline(work: Path, world: int, args: argparse.Namespace, net=None, alone: bool = False) -> dict:
    """`world` ddp_baseline.py ranks (1 = the single node, with nodes x the steps). `alone`: instead
    `args.nodes` independent single processes at once, each on its core with a node's share of the
    steps and no communication: plain torch per node under the same load as a swarm's nodes."""
    work.mkdir(parents=True)
    rec = make_task_repo(work / "repo", recipe(args))
    master = f"{net.addr(0)}:29500" if net else f"127.0.0.1:{_free_port()}"
    env = {**os.environ, "OMP_NUM_THREADS": "1", "GLOO_SOCKET_IFNAME": net.ifname if net else "lo"}
    t0 = time.time()
    procs = []
    try:
        for rank in range(args.nodes if alone else world):
            cmd = [
                *(net.exec_prefix(rank) if net else []),
                *pin(rank % os.cpu_count()),
                sys.executable,
                str(ROOT / "benchmarks" / "ddp_baseline.py"),
                str(rec),
                "--rank",
                str(0 if alone else rank),
                "--world",
                str(1 if alone else world),
                "--master",
                master,
                "--steps-scale",
                str(args.nodes if world == 1 and not alone else 1),
                "--out",
                str(work / (f"run{rank}" if alone and rank else "run")),
            ]
            procs.append(
                subprocess.Popen(cmd, stdout=open(work / f"rank{rank}.log", "w"), stderr=subprocess.STDOUT, env=env)
            )
        for rank, p in enumerate(procs):
            if p.wait(timeout=3600) != 0:
                raise SystemExit(f"baseline rank {rank} failed:\n{(work / f'rank{rank}.log').read_text()[-3000:]}")
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    return {"run_dir": work / "run", "total_s": time.time() - t0}


def parse_link(link: str) -> tuple[str, float]:
    """'100mbit' -> ('100mbit', 0); '100mbit+25ms' -> ('100mbit', 25.0); 'loopback' -> no namespaces."""
    if link.strip() == "loopback":
        return "loopback", 0
    m = re.fullmatch(r"(\d+[kmg]?bit)(?:\+(\d+(?:\.\d+)?)ms)?", link.strip())
    if not m:
        raise SystemExit(f"--links: {link!r} is not RATE or RATE+Dms (e.g. 100mbit, 10mbit+25ms)")
    return m.group(1), float(m.group(2) or 0)


def section(link: str, work: Path, args: argparse.Namespace, net, single: dict | None) -> dict:
    """Run ddp and both drift rules over one kind of link (the single node shown beside them)."""
    print(f"\n== {link} ==", flush=True)
    runs: dict[str, dict] = {} if single is None else {"single": single}
    plan = {
        "plain-pair": lambda w: run_baseline(w, 1, args, net, alone=True),
        "ddp": lambda w: run_baseline(w, args.nodes, args, net),
        "drift-blocking": lambda w: run_drift(w, "blocking", args, net),
        "drift-overlapped": lambda w: run_drift(w, "overlapped", args, net),
    }
    for label in [x for x in RUNS if x in args.runs and x in plan]:
        wire0 = [net.tx_bytes(i) for i in range(args.nodes)] if net else None
        res = keep(plan[label](work / label), args.out / link / label)
        if net:
            res["wire_mib"] = sum(net.tx_bytes(i) - b for i, b in enumerate(wire0)) / args.nodes / MiB
        runs[label] = res
        print(f"  {label:<16} done: val {res['run'].final_val():.4f}, {res['total_s']:.0f} s in all", flush=True)
    table(link, runs)
    out = args.out / link
    subprocess.run(
        [sys.executable, "-m", "drift", "report", *(str(r["run_dir"]) for r in runs.values()), "--out", str(out)],
        check=True,
        capture_output=True,
    )
    print(f"  plots: {out}/loss.png, nodes.png, bytes.png, utilization.png", flush=True)
    return runs


def keep(res: dict, dest: Path) -> dict:
    """Copy a run's metrics out of the temp dir (the label is the directory's name) and load them."""
    dest.mkdir(parents=True, exist_ok=True)
    (dest / "metrics.jsonl").write_bytes((Path(res["run_dir"]) / "metrics.jsonl").read_bytes())
    res["run_dir"] = dest
    res["run"] = load_run(dest, dest.name)
    return res


def table(link: str, runs: dict[str, dict]) -> None:
    target = max(r["run"].final_val() for r in runs.values())
    ddp: Run = runs["ddp"]["run"]
    ddp_tt, ddp_mib = ddp.time_to(target), ddp.mib_per_node()
    c = ddp.complete
    ideal = c["step_wall_s"] / c["pure_compute_s"] if c.get("pure_compute_s") else None
    print(
        f"\n{link}: target val loss {target:.4f} (the worst final); ddp per step {1000 * c.get('step_wall_s', 0):.1f} ms "
        f"wall, {1000 * c.get('pure_compute_s', 0):.1f} ms pure compute: ideal speed-up "
        f"{f'{ideal:.2f}x' if ideal else '-'}"
    )
    print(
        f"  {'run':<16} {'val loss':>8} {'vs ddp':>7} {'train s':>8} {'MiB/node':>9} {'ddp/this':>9} {'wire MiB':>9} "
        f"{'util %':>7} {'to target':>9} {'speed-up':>8} {'capture':>7} {'samples/s/node':>14} {'vs single':>9} {'vs pair':>8}"
    )
    single_rate = per_node_rate(runs["single"]["run"]) if "single" in runs else None
    pair_rate = per_node_rate(runs["plain-pair"]["run"]) if "plain-pair" in runs else None
    ddp_curve = [(x, v) for x, _, v in ddp.val_curve()]
    for label, res in runs.items():
        r: Run = res["run"]
        fv, mib, tt = r.final_val(), r.mib_per_node(), r.time_to(target)
        vs_ddp = fv / ddp_val_at(ddp_curve, r.val_curve()[-1][0]) - 1
        u = r.utilization().values()
        util = f"{100 * min(u):.0f}-{100 * max(u):.0f}" if u else "-"
        wire = f"{res['wire_mib']:9.1f}" if res.get("wire_mib") is not None else f"{'-':>9}"
        ratio = f"{ddp_mib / mib:8.0f}x" if mib else f"{'-':>9}"
        tts = f"{tt:8.1f}s" if tt is not None else f"{'never':>9}"
        speed = ddp_tt / tt if tt and ddp_tt else None
        cap = f"{100 * speed / ideal:6.0f}%" if speed and ideal and label.startswith("drift") else f"{'-':>7}"
        rate = per_node_rate(r)
        vs_single = f"{100 * rate / single_rate:8.1f}%" if single_rate else f"{'-':>9}"
        vs_pair = f"{100 * rate / pair_rate:7.1f}%" if pair_rate else f"{'-':>8}"
        print(
            f"  {label:<16} {fv:8.4f} {100 * vs_ddp:+6.1f}% {r.rounds[-1]['t']:8.1f} "
            f"{mib:9.2f} {ratio} {wire} {util:>7} {tts} {f'{speed:7.2f}x' if speed else '-':>8} {cap} "
            f"{rate:14.1f} {vs_single} {vs_pair}"
        )
    print(
        "  (vs ddp: final val loss relative to ddp's at the same samples (drift's rounds stop at the next inner "
        "step, so they train a few % fewer samples than their budget: ddp's curve is interpolated there); ddp/this: ddp's MiB per node over this run's; util: "
        "least-most of the nodes' time in inner steps; speed-up: ddp's time to target over this run's; "
        "capture: speed-up over the ideal; samples/s/node: the samples the run trained over its wall-clock "
        "from training start to its last round, per node; vs single: that over the single process's, which is plain "
        "torch on one core alone; vs pair: over plain-pair's, the same plain loop run as one process per node "
        "at once, each on its core, no communication: plain torch per node under a swarm's load)",
        flush=True,
    )


def per_node_rate(r: Run) -> float:
    """Samples trained per second per node, from training start to the last round's end."""
    nodes = {name for rnd in r.rounds for name in rnd.get("nodes", {})} or {"single"}
    return sum(rnd["samples"] for rnd in r.rounds) / r.rounds[-1]["t"] / len(nodes)


def ddp_val_at(curve: list[tuple[int, float]], samples: int) -> float:
    """ddp's val loss after `samples` samples, linear between its evaluations."""
    for (x0, v0), (x1, v1) in itertools.pairwise(curve):
        if x0 <= samples <= x1:
            return v0 + (v1 - v0) * (samples - x0) / (x1 - x0) if x1 > x0 else v1
    return curve[-1][1]


def reprint(out: Path) -> None:
    """The tables of an earlier run, from OUT/results.json and the metrics kept under OUT."""
    for link, saved in json.loads((out / "results.json").read_text()).items():
        runs = {}
        for label, res in saved.items():
            run_dir = out / link / label if (out / link / label).exists() else out / "single"
            runs[label] = {
                "total_s": res["total_s"],
                "run": load_run(run_dir, label),
                "wire_mib": res.get("wire_mib_per_node"),
            }
        table(link, runs)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--nodes", type=int, default=2, help="one per core")
    ap.add_argument("--rounds", type=int, default=20, help="outer rounds (the recipe has 12)")
    ap.add_argument("--inner-steps", type=int, default=25, help="H (the recipe's)")
    ap.add_argument("--codec", default="int8")
    ap.add_argument("--links", default="100mbit,10mbit,100mbit+25ms", help="RATE or RATE+Dms, comma-separated")
    ap.add_argument("--runs", default=",".join(RUNS), help=f"which of {','.join(RUNS)} (ddp always)")
    ap.add_argument(
        "--tables",
        type=Path,
        metavar="OUT",
        help="print the tables of an earlier run's OUT again (from its metrics and results.json), run nothing",
    )
    ap.add_argument("--out", type=Path, default=ROOT / "runs" / time.strftime("bench-vs-ddp-%Y%m%d-%H%M%S"))
    args = ap.parse_args()
    args.runs = {x.strip() for x in args.runs.split(",")} | {"ddp"}
    if args.runs - set(RUNS):
        ap.error(f"--runs: unknown {sorted(args.runs - set(RUNS))}; choose from {', '.join(RUNS)}")
    if args.tables:
        reprint(args.tables)
        return
    links = [parse_link(x) for x in args.links.split(",")]
    from netns import NetnsUnavailable
    from netns import Swarm as Links

    args.out.mkdir(parents=True, exist_ok=True)
    print(
        f"{args.nodes} nodes, {args.rounds} rounds x {args.inner_steps} inner steps, codec {args.codec}; "
        f"plots and runs in {args.out}",
        flush=True,
    )
    results: dict[str, dict] = {}
    with tempfile.TemporaryDirectory(prefix="drift-vs-ddp-") as tmp:
        work = Path(tmp)
        single = None
        if "single" in args.runs:
            single = keep(run_baseline(work / "single", 1, args), args.out / "single")
            print(f"  single done: val {single['run'].final_val():.4f}, {single['total_s']:.0f} s", flush=True)
        for rate, delay in links:
            link = f"{rate}+{delay:g}ms" if delay else rate
            try:
                if rate == "loopback":
                    results[link] = section(link, work / link, args, None, single)
                else:
                    with Links(n=args.nodes + 1, rate=rate, delay_ms=delay) as net:
                        results[link] = section(link, work / link, args, net, single)
            except NetnsUnavailable as e:
                print(f"\n{link} skipped: {e}")
            summary = {
                name: {
                    label: {
                        "final_val": res["run"].final_val(),
                        "train_s": res["run"].rounds[-1]["t"],
                        "total_s": res["total_s"],
                        "mib_per_node": res["run"].mib_per_node(),
                        "wire_mib_per_node": res.get("wire_mib"),
                        "utilization": res["run"].utilization(),
                    }
                    for label, res in runs.items()
                }
                for name, runs in results.items()
            }
            (args.out / "results.json").write_text(json.dumps(summary, indent=2))


if __name__ == "__main__":
    main()
