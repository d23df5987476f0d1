#!/usr/bin/env python3
"""PyTorch Geometric baseline for `grandis bench train`.

Reads the graph that grandis wrote (edge_index.npy: int64 2 x E, sources in row 0 and
destinations in row 1; features.npy: f32 N x F; labels.npy: int64 N; train.npy: int64 ids),
trains a full-batch GraphSAGE (SAGEConv, mean aggregator, edge_index input, ReLU, dropout
before every convolution like grandis) with Adam on the CPU, and prints one JSON line:
median_epoch_s, peak_rss_bytes and versions.
"""
import argparse
import json
import os
import resource
import statistics
import sys
import time


def main():
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--dir", required=True)
    ap.add_argument("--layers", type=int, default=3)
    ap.add_argument("--hidden", type=int, default=64)
    ap.add_argument("--dropout", type=float, default=0.5)
    ap.add_argument("--epochs", type=int, default=5)
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()

    import numpy as np
    import torch
    import torch.nn.functional as F
    import torch_geometric
    from torch_geometric.nn import SAGEConv

    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    d = args.dir
    edge_index = torch.from_numpy(np.load(os.path.join(d, "edge_index.npy")))
    x = torch.from_numpy(np.load(os.path.join(d, "features.npy")))
    y = torch.from_numpy(np.load(os.path.join(d, "labels.npy")))
    train = torch.from_numpy(np.load(os.path.join(d, "train.npy")))
    classes = int(y.max()) + 1

    dims = [x.shape[1]] + [args.hidden] * (args.layers - 1) + [classes]
    convs = torch.nn.ModuleList(
        SAGEConv(dims[i], dims[i + 1], aggr="mean") for i in range(args.layers)
    )
    opt = torch.optim.Adam(convs.parameters(), lr=0.01)

    def forward(h):
        for i, conv in enumerate(convs):
            h = F.dropout(h, p=args.dropout, training=True)
            h = conv(h, edge_index)
            if i + 1 < len(convs):
                h = F.relu(h)
        return h

    times = []
    for epoch in range(args.epochs + 1):
        start = time.perf_counter()
        opt.zero_grad()
        out = forward(x)
        loss = F.cross_entropy(out[train], y[train])
        loss.backward()
        opt.step()
        elapsed = time.perf_counter() - start
        print(f"pyg epoch {epoch}: loss {loss.item():.4f}, {elapsed:.3f}s", file=sys.stderr)
        if epoch > 0:  # the first epoch is warm-up, as in grandis
            times.append(elapsed)

    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    print(
        json.dumps(
            {
                "median_epoch_s": statistics.median(times),
                "epoch_seconds": times,
                "peak_rss_bytes": peak,
                "torch": torch.__version__,
                "torch_geometric": torch_geometric.__version__,
                "threads": torch.get_num_threads(),
            }
        )
    )


if __name__ == "__main__":
    main()
