"""The sparse rule's curve (issue 25): val loss against bytes sent per node over the run, per N, H
and k, every run at the same total of samples, against the int8 ring at the same N.

    python3 benchmarks/sparse_curve.py --nodes 2 4                       # the default grid at 2 and 4 nodes
    python3 benchmarks/sparse_curve.py --nodes 4 --dense-H --sparse-H 10 --k 32 128   # add k at one H
    python3 benchmarks/sparse_curve.py --nodes 2 4 8 16 --table          # print what --results holds
    python3 benchmarks/sparse_curve.py --nodes 4 --dense-H --sparse-H 25 10 --sparse-lr 1.5 2 3 --ef-decay 0.9 0.95 1
    python3 benchmarks/sparse_curve.py --nodes 2 --samples 12800 --dense-H 10 --sparse-H 10 5 --base-H 10 --model n_layer=7 n_head=8 n_embd=512 --inner-lr 1e-3 --results benchmarks/sparse_curve_22m.jsonl

Each run is one benchmarks/diloco_sim.py process, `--schedule`, outer momentum 0: dense = the
int8-coded mean, outer lr 1.3, sent over a ring (2(N-1)/N payloads per node per round); sparse =
drift's `sync: sparse` (error feedback 0.95, top-k of each `--chunk`, a sign bit a value, clip 1),
outer lr 2, all-gathered directly (N-1 payloads). Steps per replica = samples / (N x batch 32).
Results are appended to `--results` (JSON lines) and a run already there is not run again.
Printed, one row per run: val loss after the last round, MiB sent per node, how many times fewer
bytes than int8 at the same N and H 25 (the recipe's H), and the loss against that run (the best
of them where several inner-lr schedules ran: `--min-lr 0.1 1` runs each at both).

Rows run before 2026-12-03's fix to diloco_sim.py (its cosine spanned the recipe file's 3 nodes x
H 25 a round, not the run's, so the inner lr barely decayed) are in sparse_curve_stretched.jsonl.
"""

from __future__ import annotations

import argparse
import fcntl
import json
import re
import subprocess
import sys
import time
from contextlib import nullcontext
from pathlib import Path

HERE = Path(__file__).resolve().parent

from drift.sync.sparse import Codec  # noqa: E402

BATCH = 32  # recipes/shakespeare.yaml's batch_size
LR, EF = 2.0, 0.95  # the sparse runs' outer lr and error-feedback decay unless --sparse-lr, --ef-decay
MIN_LR = 0.1  # the inner lr's cosine ends at this fraction of it unless --min-lr
FORMAT = "sign"  # the payload's values: a sign bit each (rows without "format": 2 bits, two magnitudes a chunk)


def sim_args(
    n: int,
    rule: str,
    h: int,
    k: int,
    samples: int,
    chunk: int,
    seed: int | None,
    extra: list[str],
    lr: float,
    ef: float,
    min_lr: float,
) -> list[str]:
    steps, rest = divmod(samples, n * BATCH)
    if rest or steps % h:
        raise SystemExit(f"{samples} samples: not whole rounds of H {h} at {n} nodes x batch {BATCH}")
    args = ["diloco", "--nodes", str(n), "--steps", str(steps), "--H", str(h), "--schedule", "--momentum", "0"]
    args += ([] if seed is None else ["--seed", str(seed)]) + extra
    args += [] if min_lr == MIN_LR else ["--min-lr", f"{min_lr:g}"]
    if rule == "int8":
        return [*args, "--int8", "--outer-lr", "1.3"]
    args += ["--sync", "sparse", "--outer-lr", f"{lr:g}", "--clip", "1", "--k", str(k), "--chunk", str(chunk)]
    return args + ([] if ef == EF else ["--ef-decay", f"{ef:g}"])


def run(args: list[str], lock: str | None) -> dict:
    with open(lock, "w") if lock else nullcontext() as f:
        if f:
            fcntl.flock(f, fcntl.LOCK_EX)  # a shared machine: one benchmark at a time
        t = time.monotonic()
        out = subprocess.run(
            [sys.executable, str(HERE / "diloco_sim.py"), *args], capture_output=True, text=True, check=True
        ).stdout
    vals = [float(v) for v in re.findall(r"val (\S+)", out)]
    sent, values, rounds = re.search(r"\((\d+) bytes, (\d+) values, (\d+) rounds\)", out).groups()
    return {
        "val": vals[-1],
        "vals": vals,
        "sent": int(sent),
        "values": int(values),
        "rounds": int(rounds),
        "wall_s": round(time.monotonic() - t),
    }


def recount(r: dict) -> None:
    """A 2-bit sparse row's bytes with Elias-Fano indices. Rows run before 2026-12-03 (no "values")
    hold the plain-index format's count (12 of log2(chunk) bits an index); Elias-Fano indices
    carry the same values in fewer bytes, so only the count changes. (Rows of today's format, a
    sign bit a value, are counted as sent.)"""
    chunk, payloads = r["chunk"], r["rounds"] * (r["N"] - 1)
    if r["format"] == FORMAT:
        return
    if "values" not in r:  # 8 + k (log2(chunk) + 2) / 8 bytes a chunk then (k a multiple of 4)
        r["values"] = chunk * (r["sent"] // payloads // (8 + r["k"] * (chunk.bit_length() + 1) // 8))
    c = Codec(r["values"], chunk, r["k"])  # its index fields; then two float32 magnitudes and 2 bits a value
    r["sent"] = payloads * (8 * c.m + (c.i_values - c.i_index) + -(-c.m * c.k * 2 // 8))


def table(results: list[dict], base_h: int) -> None:
    int8 = [r for r in results if r["rule"] == "int8" and r["H"] == base_h]
    base = {r["N"]: r for r in sorted(int8, key=lambda r: -r["val"])}  # per N the best (of every schedule run)
    print(
        f"| N | rule | H | k | rounds | val loss | MiB sent per node | × fewer bytes than int8 H {base_h} | loss vs int8 H {base_h} |"
    )
    print("|---|---|---|---|---|---|---|---|---|")
    order = {"int8": 0, "sparse": 1}
    tuned = len({(r["lr"], r["ef"]) for r in results if r["rule"] == "sparse"}) > 1
    if tuned:
        print("(sparse rows: outer lr / error-feedback decay after k)")
    schedules = len({r["min_lr"] for r in results}) > 1
    if schedules:
        print("(min lr: where the inner lr's cosine ends, x the lr)")
    for r in sorted(
        results,
        key=lambda r: (r["N"], order[r["rule"]], -r["H"], r["k"] or 0, r["lr"] or 0, r["ef"] or 0, r["min_lr"]),
    ):
        b = base.get(r["N"])
        ratio = f"{b['sent'] / r['sent']:.1f}" if b else "–"
        dloss = f"{100 * (r['val'] / b['val'] - 1):+.1f} %" if b else "–"
        rule = "int8 ring" if r["rule"] == "int8" else "sparse all-gather"
        k = r["k"] or "–"
        if r["chunk"] not in (None, 4096):
            k = f"{k} of {r['chunk']}"
        if r["format"] not in (None, FORMAT):
            k = f"{k}, 2-bit"
        if tuned and r["rule"] == "sparse":
            k = f"{k}, lr {r['lr']:g}, ef {r['ef']:g}"
        if schedules:
            k = f"{k}, min lr {r['min_lr']:g}"
        print(
            f"| {r['N']} | {rule} | {r['H']} | {k} | {r['rounds']} | {r['val']:.3f} | {r['sent'] / 2**20:.3f} | {ratio} | {dloss} |"
        )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--nodes", type=int, nargs="+", default=[2, 4, 8, 16])
    ap.add_argument("--samples", type=int, default=25600, help="total over all replicas (N x batch 32 x H divides it)")
    ap.add_argument("--dense-H", type=int, nargs="*", default=[25, 10], help="int8 runs at these H")
    ap.add_argument("--sparse-H", type=int, nargs="*", default=[25, 10, 5], help="sparse runs at these H")
    ap.add_argument("--k", type=int, nargs="+", default=[64], help="sparse: values kept per chunk")
    ap.add_argument("--chunk", type=int, default=4096)
    ap.add_argument("--sparse-lr", type=float, nargs="+", default=[LR], help="sparse: outer learning rates")
    ap.add_argument("--ef-decay", type=float, nargs="+", default=[EF], help="sparse: error-feedback decays")
    ap.add_argument("--min-lr", type=float, nargs="+", default=[MIN_LR], help="inner lr's cosine end, x the lr")
    ap.add_argument("--seed", type=int, help="θ0 and the sample order (default: the recipe's, 1337)")
    ap.add_argument("--results", default=str(HERE / "sparse_curve.jsonl"), help="JSON lines, read and appended")
    ap.add_argument("--lock", help="hold this file's flock during each run (a machine shared with others)")
    ap.add_argument("--model", nargs="*", default=[], metavar="KEY=INT", help="task_config: a larger char GPT")
    ap.add_argument("--inner-lr", type=float, help="AdamW's lr (default: the recipe's)")
    ap.add_argument(
        "--uneven", type=int, metavar="DEAL", help="diloco_sim's --uneven DEAL: shares as the steal schedule deals"
    )
    ap.add_argument("--base-H", type=int, default=25, help="the int8 run the others are measured against")
    ap.add_argument("--table", action="store_true", help="run nothing: the table of --results for --nodes")
    ap.add_argument(
        "--recount", action="store_true", help="2-bit sparse rows' bytes with Elias-Fano indices (see recount)"
    )
    a = ap.parse_args()

    path = Path(a.results)
    done = [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []
    for r in done:  # rows from before the grid over lr and decay ran at the defaults
        sparse = r["rule"] == "sparse"
        r.setdefault("lr", LR if sparse else None)
        r.setdefault("ef", EF if sparse else None)
        r.setdefault("extra", [])
        r.setdefault("min_lr", MIN_LR)
        r["chunk"] = int(r["args"][r["args"].index("--chunk") + 1]) if sparse else None
        r.setdefault("format", "2-bit" if sparse else None)  # rows from before the sign-bit format
    extra = (["--model", *a.model] if a.model else []) + ([] if a.inner_lr is None else ["--inner-lr", str(a.inner_lr)])
    extra += [] if a.uneven is None else ["--uneven", str(a.uneven)]
    grid = [(n, "int8", h, None, None, None, m) for n in a.nodes for h in a.dense_H for m in a.min_lr]
    grid += [
        (n, "sparse", h, k, lr, ef, m)
        for n in a.nodes
        for h in a.sparse_H
        for k in a.k
        for lr in a.sparse_lr
        for ef in a.ef_decay
        for m in a.min_lr
    ]
    for n, rule, h, k, lr, ef, m in [] if a.table else grid:
        args = sim_args(n, rule, h, k or 0, a.samples, a.chunk, a.seed, extra, lr or LR, ef or EF, m)
        fmt = FORMAT if rule == "sparse" else None
        if any(r["args"] == args and r["format"] == fmt for r in done):
            continue  # (a sparse row of the 2-bit format is run again in today's)
        r = {"N": n, "rule": rule, "H": h, "k": k, "lr": lr, "ef": ef, "min_lr": m, "samples": a.samples}
        r |= {"seed": a.seed, "extra": extra, "args": args, "chunk": a.chunk if rule == "sparse" else None}
        r["format"] = fmt
        r |= run(args, a.lock)
        done.append(r)
        with path.open("a") as f:
            f.write(json.dumps(r) + "\n")
        print(f"N {n} {rule} H {h} k {k}: val {r['val']:.4f}, {r['sent']} bytes, {r['wall_s']} s", file=sys.stderr)
    same = [r for r in done if r["N"] in a.nodes and r["samples"] == a.samples and r.get("seed") == a.seed]
    rows = [r for r in same if r["extra"] == extra]
    for r in rows if a.recount else []:
        if r["rule"] == "sparse":
            recount(r)
    table(rows, a.base_H)


if __name__ == "__main__":
    main()
