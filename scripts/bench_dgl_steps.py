#!/usr/bin/env python3
"""DGL baseline for `grandis bench steps`: DGL's CPU neighbour sampler and feature gather.

Reads the graph that `grandis bench steps --baseline dgl` writes (indptr.npy: int64 V+1 and
indices.npy: int64 E, the in-neighbours of every vertex as grandis stores them, i.e. a CSC
of the edges src -> dst; x.npy: f32 V x F; train_idx.npy: int64), then for --steps batches of
--batch-size shuffled training vertices times `NeighborSampler.sample_blocks` (sampling and
building the per-layer blocks) and `x[input_nodes]` (the feature gather), and prints one JSON
line: per-step seconds of each, the sampled edges and input rows per step, and versions.

--fanouts is given hop 1 first (grandis's and PyG's order: 15,10,5 gives every seed 15
in-neighbours); DGL's NeighborSampler lists the fanout of the input layer first, so it gets
them reversed. Threads: OMP_NUM_THREADS and torch.set_num_threads (--threads).
"""
import argparse
import json
import os
import sys
import time


def main():
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--dir", required=True)
    ap.add_argument("--fanouts", default="15,10,5")
    ap.add_argument("--batch-size", type=int, default=1024)
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--seed", type=int, default=1)
    args = ap.parse_args()
    os.environ["OMP_NUM_THREADS"] = str(args.threads)
    os.environ.setdefault("DGLBACKEND", "pytorch")

    import numpy as np
    import torch
    import dgl

    torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)
    dgl.seed(args.seed)
    d = args.dir
    indptr = torch.from_numpy(np.load(os.path.join(d, "indptr.npy")).astype(np.int64))
    indices = torch.from_numpy(np.load(os.path.join(d, "indices.npy")).astype(np.int64))
    x = torch.from_numpy(np.load(os.path.join(d, "x.npy")))
    train = torch.from_numpy(np.load(os.path.join(d, "train_idx.npy")).astype(np.int64))
    g = dgl.graph(("csc", (indptr, indices, torch.tensor([], dtype=torch.int64))),
                  num_nodes=indptr.numel() - 1)
    g = g.formats(["csc"])
    fanouts = [int(f) for f in args.fanouts.split(",")]
    sampler = dgl.dataloading.NeighborSampler(list(reversed(fanouts)))
    order = train[torch.randperm(train.numel())]
    steps = []
    for i in range(args.steps):
        seeds = order[i * args.batch_size:(i + 1) * args.batch_size]
        if seeds.numel() == 0:
            break
        t = time.perf_counter()
        input_nodes, _, blocks = sampler.sample_blocks(g, seeds)
        sample_s = time.perf_counter() - t
        t = time.perf_counter()
        rows = x[input_nodes]
        gather_s = time.perf_counter() - t
        steps.append({
            "sample_blocks_s": sample_s,
            "gather_s": gather_s,
            "sampled_edges": int(sum(b.num_edges() for b in blocks)),
            "input_rows": int(input_nodes.numel()),
        })
        del rows
    print(json.dumps({
        "steps": steps,
        "threads": args.threads,
        "versions": {"dgl": dgl.__version__, "torch": torch.__version__,
                     "python": sys.version.split()[0]},
    }))


if __name__ == "__main__":
    main()
