"""The headline: drift (DiLoCo) against synchronous data-parallel training, side by side.

    sudo flock /tmp/drift-bench.lock python benchmarks/bench_vs_ddp.py [--no-netns] [--rates 100mbit,10mbit] [--out DIR]

On the default Shakespeare task (recipes/shakespeare.yaml: model, batch, AdamW, outer optimizer;
6 rounds x H=50 inner steps here, where the recipe has 12 x 25) with 4 nodes, all with the same
total samples and inner optimizer settings:
  single      one node trains all the samples alone (4 x the steps, 1 thread)
  ddp         torch DistributedDataParallel over gloo: gradients all-reduced every step
  drift-fp32  drift: 4 real `drift join` processes over iroh, pseudo-gradients in fp32
  drift-int8  ... int8 (drift's default codec)
  drift-topk  ... top-k 1 % with error feedback
first on loopback, then on links of each --rates between network namespaces (benchmarks/netns.py:
each node's upload and download limited by tc tbf, no route out, deleted on exit). The
coordinator sits in a fifth namespace behind its own limited link.

Reports per run: final val loss, training wall-clock (from training start to the last evaluation),
MiB sent per node (as the senders count payload; on the limited links also the interface's own
counter, every header included), and time to a target val loss. The target is the worse of the
ddp and drift-int8 final losses, so both reach it. `drift report` draws the plots of each
section into OUT/<section>/.

Every process runs with 1 torch thread; 4 nodes share this machine's cores, so wall-clock is
compute on shared cores plus what the network adds.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import yaml

sys.path.insert(0, str(Path(__file__).resolve().parent))
from drift.report import Run, load_run  # noqa: E402
from drift.simulate import Swarm, make_task_repo  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
MiB = 2**20
CODECS = ("fp32", "int8", "topk")
RUNS = ("single", "ddp", *(f"drift-{c}" for c in CODECS))


def recipe(nodes: int, codec: str, args: argparse.Namespace) -> dict:
    r = yaml.safe_load((ROOT / "recipes" / "shakespeare.yaml").read_text())
    r.pop("task")  # make_task_repo sets it
    r.update(name=f"vs-ddp-{codec}", min_nodes=nodes, codec=codec, rounds=args.rounds,
             inner_steps=args.inner_steps, checkpoint_every=args.rounds,  # one checkpoint, after the last round
             network="local")
    return r


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_drift(work: Path, codec: str, args: argparse.Namespace, net=None) -> dict:  # noqa: ANN001 - netns.Swarm
    work.mkdir(parents=True)
    rec = make_task_repo(work / "repo", recipe(args.nodes, codec, args))
    coord_args = ["--network", "lan"] if net else []
    t0 = time.time()
    swarm = Swarm(rec, work, *coord_args, wrap=net.exec_prefix(args.nodes) if net else None)
    for i in range(args.nodes):
        swarm.join(name=f"n{i}", wrap=net.exec_prefix(i) if net else None)
    rc = swarm.finish(timeout=3600)
    if rc != 0:
        raise SystemExit(f"drift-{codec} failed:\n{swarm.log()[-3000:]}")
    return {"run_dir": swarm.run_dir, "total_s": time.time() - t0}


def run_baseline(work: Path, world: int, args: argparse.Namespace, net=None) -> dict:  # noqa: ANN001
    """`world` ddp_baseline.py ranks (1 = the single node, with world x the steps)."""
    work.mkdir(parents=True)
    rec = make_task_repo(work / "repo", recipe(args.nodes, "fp32", args))
    master = f"{net.addr(0)}:29500" if net else f"127.0.0.1:{_free_port()}"
    env = {**os.environ, "OMP_NUM_THREADS": "1", "GLOO_SOCKET_IFNAME": net.ifname if net else "lo"}
    t0 = time.time()
    procs = []
    try:
        for rank in range(world):
            cmd = [*(net.exec_prefix(rank) if net else []), sys.executable, str(ROOT / "benchmarks" / "ddp_baseline.py"),
                   str(rec), "--rank", str(rank), "--world", str(world), "--master", master,
                   "--steps-scale", str(args.nodes if world == 1 else 1), "--out", str(work / "run")]
            procs.append(subprocess.Popen(cmd, stdout=open(work / f"rank{rank}.log", "w"), stderr=subprocess.STDOUT,
                                          env=env))
        for rank, p in enumerate(procs):
            if p.wait(timeout=3600) != 0:
                raise SystemExit(f"baseline rank {rank} failed:\n{(work / f'rank{rank}.log').read_text()[-3000:]}")
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    return {"run_dir": work / "run", "total_s": time.time() - t0}


def section(name: str, work: Path, args: argparse.Namespace, net=None, single: dict | None = None) -> dict:  # noqa: ANN001
    """Run the chosen runs on one network. The single node needs no network: it runs on loopback
    only, and a limited section shows the loopback one (`single`)."""
    print(f"\n== {name} ==", flush=True)
    runs: dict[str, dict] = {}
    plan = {"single": lambda w: run_baseline(w, 1, args), "ddp": lambda w: run_baseline(w, args.nodes, args, net),
            **{f"drift-{c}": (lambda w, c=c: run_drift(w, c, args, net)) for c in CODECS}}
    for label in [x for x in RUNS if x in args.runs and (x != "single" or net is None)]:
        fn = plan[label]
        wire0 = [net.tx_bytes(i) for i in range(args.nodes)] if net else None
        res = fn(work / label)
        keep = args.out / name / label  # the metrics outlive the temp dir; the label is the dir's name
        keep.mkdir(parents=True, exist_ok=True)
        (keep / "metrics.jsonl").write_bytes((Path(res["run_dir"]) / "metrics.jsonl").read_bytes())
        res["run_dir"] = keep
        if net:
            res["wire_mib"] = sum(net.tx_bytes(i) - b for i, b in enumerate(wire0)) / args.nodes / MiB
        res["run"] = load_run(res["run_dir"], label)
        runs[label] = res
        fv = res["run"].final_val()
        print(f"  {label:<11} done: val {fv:.4f}, {res['total_s']:.0f} s in all", flush=True)
    if single is not None:
        runs = {"single": single, **runs}
    table(name, runs)
    out = args.out / name
    subprocess.run([sys.executable, "-m", "drift", "report", *(str(r["run_dir"]) for r in runs.values()),
                    "--out", str(out)], check=True, capture_output=True)
    print(f"  plots: {out}/loss.png, nodes.png, bytes.png")
    return runs


def table(name: str, runs: dict[str, dict]) -> None:
    target = max(runs["ddp"]["run"].final_val(), runs["drift-int8"]["run"].final_val())
    ddp: Run = runs["ddp"]["run"]
    ddp_bytes = ddp.mib_per_node()
    ddp_tt = ddp.time_to(target)
    print(f"\n{name}: target val loss {target:.4f} (the worse of ddp's and drift-int8's final)")
    print(f"  {'run':<11} {'val loss':>8} {'vs ddp':>7} {'train s':>8} {'total s':>8} {'MiB/node':>9} "
          f"{'ddp/this':>9} {'wire MiB':>9} {'to target':>9} {'speedup':>8}")
    for label, res in runs.items():
        r: Run = res["run"]
        fv, mib, tt = r.final_val(), r.mib_per_node(), r.time_to(target)
        wire = f"{res['wire_mib']:9.1f}" if "wire_mib" in res else f"{'-':>9}"
        ratio = f"{ddp_bytes / mib:8.0f}x" if mib else f"{'-':>9}"
        tts = f"{tt:8.1f}s" if tt is not None else f"{'never':>9}"
        speed = f"{ddp_tt / tt:7.2f}x" if tt and ddp_tt else f"{'-':>8}"
        print(f"  {label:<11} {fv:8.4f} {100 * (fv / ddp.final_val() - 1):+6.1f}% {r.rounds[-1]['t']:8.1f} "
              f"{res['total_s']:8.1f} {mib:9.2f} {ratio} {wire} {tts} {speed}")
    print("  (vs ddp: final val loss relative to ddp's; ddp/this: ddp's MiB per node over this run's; "
          "speedup: ddp's time to target over this run's)", flush=True)


def reprint(out: Path) -> None:
    """The tables of an earlier run, from OUT/results.json and the metrics kept under OUT."""
    for name, saved in json.loads((out / "results.json").read_text()).items():
        runs = {}
        for label, res in saved.items():
            run_dir = out / name / label
            if not run_dir.exists():  # the single node runs once, on loopback
                run_dir = out / "loopback" / label
            runs[label] = {"total_s": res["total_s"], "run": load_run(run_dir, label)}
            if res.get("wire_mib_per_node") is not None:
                runs[label]["wire_mib"] = res["wire_mib_per_node"]
        table(name, runs)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--nodes", type=int, default=4)
    ap.add_argument("--rounds", type=int, default=6, help="outer rounds (the recipe has 12)")
    ap.add_argument("--inner-steps", type=int, default=50, help="H (the recipe has 25)")
    ap.add_argument("--rates", default="100mbit", help="link rates of the limited sections, comma-separated")
    ap.add_argument("--no-netns", action="store_true", help="loopback only")
    ap.add_argument("--no-loopback", action="store_true", help="limited links only")
    ap.add_argument("--runs", default=",".join(RUNS), help=f"which of {','.join(RUNS)} (ddp and drift-int8 always)")
    ap.add_argument("--tables", type=Path, metavar="OUT", help="print the tables of an earlier run's OUT again "
                    "(from its metrics and results.json, e.g. after a change to how they are read), run nothing")
    ap.add_argument("--out", type=Path, default=ROOT / "runs" / time.strftime("bench-vs-ddp-%Y%m%d-%H%M%S"))
    args = ap.parse_args()
    args.runs = {x.strip() for x in args.runs.split(",")} | {"ddp", "drift-int8"}
    if args.runs - set(RUNS):
        ap.error(f"--runs: unknown {sorted(args.runs - set(RUNS))}; choose from {', '.join(RUNS)}")
    if args.tables:
        reprint(args.tables)
        return
    args.out.mkdir(parents=True, exist_ok=True)
    print(f"{args.nodes} nodes, {args.rounds} rounds x {args.inner_steps} inner steps; plots and runs in {args.out}")
    with tempfile.TemporaryDirectory(prefix="drift-vs-ddp-") as tmp:
        work = Path(tmp)
        results = {} if args.no_loopback else {"loopback": section("loopback", work / "loopback", args)}
        single = results.get("loopback", {}).get("single")
        for rate in [] if args.no_netns else args.rates.split(","):
            from netns import NetnsUnavailable
            from netns import Swarm as Links
            try:
                with Links(n=args.nodes + 1, rate=rate) as net:
                    results[rate] = section(rate, work / rate, args, net, single=single)
            except NetnsUnavailable as e:
                print(f"\n{rate} section skipped: {e}")
        summary = {name: {label: {"final_val": res["run"].final_val(), "train_s": res["run"].rounds[-1]["t"],
                                  "total_s": res["total_s"], "mib_per_node": res["run"].mib_per_node(),
                                  "wire_mib_per_node": res.get("wire_mib")}
                          for label, res in runs.items()} for name, runs in results.items()}
        (args.out / "results.json").write_text(json.dumps(summary, indent=2))


if __name__ == "__main__":
    main()
