#!/usr/bin/env python3
"""PyTorch Geometric baseline for `grandis bench train`.

Reads the graph in the PyG layout that `grandis data export --format npy` writes
(edge_index.npy: int64 2 x E, sources in row 0 and destinations in row 1; x.npy: f32 N x F;
y.npy: int64 N; train_idx.npy / val_idx.npy: int64 ids), trains a full-batch GraphSAGE
(SAGEConv, mean aggregator, ReLU, dropout before every convolution like grandis) with Adam on
the CPU or a GPU (or, with --model gat, a GAT of GATConv layers: --heads heads of
hidden / heads columns concatenated in hidden layers, one averaged head in the last, attention
dropout at --dropout, ReLU like grandis), and prints one JSON line: median_epoch_s, epoch_seconds, peak_bytes (peak
RSS on the CPU, torch.cuda.max_memory_allocated on a GPU), with --eval the validation curve
(training seconds so far, accuracy) after every epoch and the final test accuracy, and
versions.

--adj csr passes a CSR adj_t (torch_geometric.utils.to_torch_csr_tensor(edge_index.flip(0))),
PyG's fastest full-graph path; --adj edge_index passes edge_index (gather/scatter).
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
    ap.add_argument("--model", choices=["sage", "gat"], default="sage")
    ap.add_argument("--heads", type=int, default=8, help="gat: heads of each hidden layer")
    ap.add_argument("--lr", type=float, default=0.01)
    ap.add_argument("--weight-decay", type=float, default=0.0, help="Adam's L2 penalty")
    ap.add_argument("--epochs", type=int, default=5)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--adj", choices=["csr", "edge_index"], default="csr")
    ap.add_argument("--eval", action="store_true", help="validation accuracy after every epoch")
    ap.add_argument("--seed", type=int, default=0, help="torch.manual_seed: weights and dropout")
    args = ap.parse_args()
    import torch

    try:
        bench(args)
    except torch.OutOfMemoryError as e:
        # Not fitting is a result, not a crash: one JSON line saying so, like a measured run.
        cuda = torch.device(args.device).type == "cuda"
        peak = torch.cuda.max_memory_allocated(args.device) if cuda else None
        print(f"pyg ({args.adj}, {args.device}): out of memory: {e}", file=sys.stderr)
        print(json.dumps({"adj": args.adj, "model": args.model, "device": args.device,
                          "error": "out of memory", "detail": str(e).splitlines()[0],
                          "peak_bytes_before_failure": peak, "torch": torch.__version__}))


def bench(args):
    import numpy as np
    import torch
    import torch.nn.functional as F
    import torch_geometric
    from torch_geometric.nn import GATConv, SAGEConv
    from torch_geometric.utils import to_torch_csr_tensor

    torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)
    dev = torch.device(args.device)
    cuda = dev.type == "cuda"
    if cuda:
        # Plain FP32 like grandis (no TF32 tensor-core rounding).
        torch.backends.cuda.matmul.allow_tf32 = False
        torch.backends.cudnn.allow_tf32 = False
    d = args.dir
    load = lambda name: torch.from_numpy(np.load(os.path.join(d, name)))
    edge_index = load("edge_index.npy").to(dev)
    x = load("x.npy").to(dev)
    y = load("y.npy").to(dev)
    train = load("train_idx.npy").to(dev)
    val = load("val_idx.npy").to(dev)
    classes = int(y.max()) + 1
    n = x.shape[0]
    if args.adj == "csr":
        adj = to_torch_csr_tensor(edge_index.flip(0), size=(n, n))
        del edge_index
    else:
        adj = edge_index
    if cuda:
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()

    dims = [x.shape[1]] + [args.hidden] * (args.layers - 1) + [classes]
    def conv(i):
        if args.model == "sage":
            return SAGEConv(dims[i], dims[i + 1], aggr="mean")
        if i + 1 < args.layers:
            return GATConv(dims[i], dims[i + 1] // args.heads, heads=args.heads, dropout=args.dropout)
        return GATConv(dims[i], dims[i + 1], heads=1, concat=False, dropout=args.dropout)

    convs = torch.nn.ModuleList(conv(i) for i in range(args.layers)).to(dev)
    opt = torch.optim.Adam(convs.parameters(), lr=args.lr, weight_decay=args.weight_decay)

    def forward(h, training):
        convs.train(training)  # GATConv's attention dropout follows the module's mode
        for i, conv in enumerate(convs):
            h = F.dropout(h, p=args.dropout, training=training)
            h = conv(h, adj)
            if i + 1 < len(convs):
                h = F.relu(h)
        return h

    sync = torch.cuda.synchronize if cuda else (lambda: None)
    times, curve, losses, trained = [], [], [], 0.0
    for epoch in range(args.epochs + 1):
        sync()
        start = time.perf_counter()
        opt.zero_grad()
        out = forward(x, True)
        loss = F.cross_entropy(out[train], y[train])
        loss.backward()
        opt.step()
        sync()
        elapsed = time.perf_counter() - start
        trained += elapsed
        losses.append(loss.item())
        line = f"pyg ({args.adj}, {args.device}) epoch {epoch}: loss {loss.item():.4f}, {elapsed:.4f}s"
        if args.eval:
            with torch.no_grad():
                pred = forward(x, False)[val].argmax(dim=1)
                acc = (pred == y[val]).float().mean().item()
            curve.append((trained, acc))
            line += f", val {acc:.4f} after {trained:.2f}s of training"
        print(line, file=sys.stderr)
        if epoch > 0:  # the first epoch is warm-up, as in grandis
            times.append(elapsed)

    test_acc = None
    if args.eval and os.path.exists(os.path.join(d, "test_idx.npy")):
        test = load("test_idx.npy").to(dev)
        with torch.no_grad():
            test_acc = (forward(x, False)[test].argmax(dim=1) == y[test]).float().mean().item()
    if cuda:
        peak, peak_name = torch.cuda.max_memory_allocated(dev), "peak device memory (torch allocator)"
    else:
        peak, peak_name = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024, "peak RSS"
    print(
        json.dumps(
            {
                "adj": args.adj,
                "model": args.model,
                "device": args.device,
                "median_epoch_s": statistics.median(times),
                "epoch_seconds": times,
                "peak_bytes": peak,
                "peak_name": peak_name,
                "peak_rss_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
                "curve": curve,
                "test_acc": test_acc,
                "losses": losses,
                "torch": torch.__version__,
                "torch_geometric": torch_geometric.__version__,
                "threads": torch.get_num_threads(),
            }
        )
    )


if __name__ == "__main__":
    main()
