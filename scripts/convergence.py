#!/usr/bin/env python3
"""Convergence of grandis against PyG, epoch by epoch, over several seeds.

    scripts/convergence.py DATASET [--seeds 5] [--layers 3] [--hidden 64] [--epochs 30]
        [--dropout 0.5] [--model sage|gat] [--heads 8] [--lr 0.01] [--weight-decay 0]
        [--threads 2] [--grandis target/release/grandis] [--python python3]

Trains the same full-batch model (GraphSAGE with the mean aggregator, or GAT with --heads
heads; ReLU, dropout before every convolution, Adam) with `grandis train` (mode single) and
with PyG (scripts/bench_pyg.py: SAGEConv or GATConv on a CSR adj_t) for each
seed, on DATASET (a grandis dataset directory; it
is exported to the PyG layout once). Prints, per system, the mean first loss, the mean number
of epochs until the training loss first falls under 1.0 and under 0.5 (or "-" if a run never
does), and the final loss, validation and test accuracy (mean ± standard deviation over seeds), then
one JSON line with every run's losses. Seeds set each system's own generator: the two systems
draw different initial weights and dropout masks, so single epochs differ; the means compare.
"""

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))


def epochs_under(losses, threshold):
    for i, loss in enumerate(losses):
        if loss < threshold:
            return i + 1
    return None


def grandis_run(a, seed):
    cmd = [a.grandis, "train", a.dataset, "--layers", str(a.layers), "--hidden", str(a.hidden),
           "--epochs", str(a.epochs), "--dropout", str(a.dropout), "--weight-decay",
           str(a.weight_decay), "--lr", str(a.lr), "--model", a.model, "--heads", str(a.heads),
           "--seed", str(seed), "--threads", str(a.threads), "--json", "-q"]
    out = subprocess.run(cmd, check=True, capture_output=True, text=True).stdout
    s = json.loads(out.strip().splitlines()[-1])
    return {"losses": s["losses"], "val_acc": s["val_acc"], "test_acc": s["test_acc"]}


def pyg_run(a, pyg_dir, seed):
    # bench_pyg.py trains epochs + 1 (its first is a warm-up): ask for one fewer.
    cmd = [a.python, os.path.join(HERE, "bench_pyg.py"), "--dir", pyg_dir, "--layers",
           str(a.layers), "--hidden", str(a.hidden), "--epochs", str(a.epochs - 1),
           "--dropout", str(a.dropout), "--threads", str(a.threads), "--model", a.model,
           "--heads", str(a.heads), "--lr", str(a.lr), "--weight-decay", str(a.weight_decay),
           "--adj", "csr", "--eval", "--seed", str(seed)]
    out = subprocess.run(cmd, check=True, capture_output=True, text=True).stdout
    s = json.loads(out.strip().splitlines()[-1])
    return {"losses": s["losses"], "val_acc": s["curve"][-1][1], "test_acc": s["test_acc"]}


def mean_sd(xs):
    xs = [x for x in xs if x is not None]
    if not xs:
        return "-"
    if len(xs) == 1:
        return f"{xs[0]:.3f}"
    return f"{statistics.mean(xs):.3f} ± {statistics.stdev(xs):.3f}"


def mean_epochs(runs, threshold):
    hits = [epochs_under(r["losses"], threshold) for r in runs]
    if any(h is None for h in hits):
        reached = sum(h is not None for h in hits)
        return f"{reached}/{len(hits)} runs reach it"
    return f"{statistics.mean(hits):.1f}"


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("dataset")
    ap.add_argument("--seeds", type=int, default=5)
    ap.add_argument("--layers", type=int, default=3)
    ap.add_argument("--hidden", type=int, default=64)
    ap.add_argument("--epochs", type=int, default=30)
    ap.add_argument("--dropout", type=float, default=0.5)
    ap.add_argument("--model", choices=["sage", "gat"], default="sage")
    ap.add_argument("--heads", type=int, default=8)
    ap.add_argument("--lr", type=float, default=0.01)
    ap.add_argument("--weight-decay", type=float, default=0.0)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--grandis", default="target/release/grandis")
    ap.add_argument("--python", default="python3")
    a = ap.parse_args()

    with tempfile.TemporaryDirectory() as tmp:
        pyg_dir = os.path.join(tmp, "pyg")
        subprocess.run([a.grandis, "data", "export", a.dataset, pyg_dir, "-q"], check=True)
        runs = {"grandis": [], "pyg": []}
        for seed in range(a.seeds):
            runs["grandis"].append(grandis_run(a, seed))
            runs["pyg"].append(pyg_run(a, pyg_dir, seed))
            print(f"seed {seed}: grandis final loss {runs['grandis'][-1]['losses'][-1]:.4f}, "
                  f"pyg {runs['pyg'][-1]['losses'][-1]:.4f}", file=sys.stderr)

    heads = f" ({a.heads} heads)" if a.model == "gat" else ""
    print(f"{a.dataset}: {a.layers}-layer {a.model}{heads}, hidden {a.hidden}, dropout "
          f"{a.dropout}, lr {a.lr}, weight decay {a.weight_decay}, {a.epochs} epochs, "
          f"{a.seeds} seeds")
    print("| system | first loss | epochs to loss < 1.0 | epochs to loss < 0.5 | final loss | "
          "final val acc | final test acc |")
    print("|---|---|---|---|---|---|---|")
    for name, rs in runs.items():
        print(f"| {name} | {mean_sd([r['losses'][0] for r in rs])} | {mean_epochs(rs, 1.0)} | "
              f"{mean_epochs(rs, 0.5)} | {mean_sd([r['losses'][-1] for r in rs])} | "
              f"{mean_sd([r['val_acc'] for r in rs])} | "
              f"{mean_sd([r['test_acc'] for r in rs])} |")
    print(json.dumps(runs))


if __name__ == "__main__":
    main()
