#!/usr/bin/env python3
"""PyTorch Geometric baseline for `grandis bench train --model rgcn|heterosage|rgat`.

Reads a typed graph in the HeteroData npy layout that `grandis data export` writes
(hetero.json: the vertex types in id order with their counts and the target type;
x_{type}.npy: float32 features of a type, absent for a featureless one;
edge_index_{src}__{rel}__{dst}.npy: int64 2 x E, ids local to their types; y.npy, train_idx.npy,
val_idx.npy, test_idx.npy: the target type's labels and split, target-local ids), pads every
type's features with zeros to the widest type (as grandis stores them), and trains the same
model grandis does, full batch with Adam on the CPU:

  rgcn        RGCNConv (mean per relation, root weight, bias) on the homogeneous graph with
              one edge type per relation, types' ids contiguous in hetero.json's order;
  heterosage  to_hetero of a SAGEConv stack (lazy in_channels), aggr="sum";
  rgat        to_hetero of a GATConv stack (add_self_loops=False, in_channels an int so one
              weight maps both ends, the MLPerf GNN model's layer), aggr="sum": --heads heads of hidden / heads columns concatenated in
              hidden layers, one averaged head in the last, attention dropout at --dropout;

dropout before every convolution, ReLU after all but the last. Prints one JSON line:
median_epoch_s, epoch_seconds (after one warm-up epoch), peak_bytes (peak RSS), final_loss,
val_acc and test_acc of the final model, versions.
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
    ap.add_argument("--model", choices=["rgcn", "heterosage", "rgat"], default="rgcn")
    ap.add_argument("--heads", type=int, default=8, help="rgat: heads of each hidden layer")
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--hidden", type=int, default=64)
    ap.add_argument("--dropout", type=float, default=0.5)
    ap.add_argument("--lr", type=float, default=0.01)
    ap.add_argument("--epochs", type=int, default=5)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--seed", type=int, default=0, help="torch.manual_seed: weights and dropout")
    args = ap.parse_args()

    import numpy as np
    import torch
    import torch.nn.functional as F
    import torch_geometric
    from torch_geometric.data import HeteroData
    from torch_geometric.nn import GATConv, RGCNConv, SAGEConv, to_hetero

    torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)
    d = args.dir
    load = lambda name: torch.from_numpy(np.load(os.path.join(d, name)))
    with open(os.path.join(d, "hetero.json")) as f:
        meta = json.load(f)
    types = [(t["name"], t["count"]) for t in meta["node_types"]]
    target = meta["target"]
    xs = {}
    for name, count in types:
        path = os.path.join(d, f"x_{name}.npy")
        xs[name] = load(f"x_{name}.npy").float() if os.path.exists(path) else torch.zeros(count, 0)
    width = max(x.shape[1] for x in xs.values())
    xs = {k: F.pad(x, (0, width - x.shape[1])) for k, x in xs.items()}
    relations = []
    for f in sorted(os.listdir(d)):
        if f.startswith("edge_index_") and f.endswith(".npy"):
            src, rel, dst = f[len("edge_index_"):-len(".npy")].split("__")
            relations.append(((src, rel, dst), load(f)))
    y = load("y.npy")
    train, val, test = (load(f"{s}_idx.npy") for s in ("train", "val", "test"))
    classes = int(y.max()) + 1
    dims = [width] + [args.hidden] * (args.layers - 1) + [classes]

    if args.model == "rgcn":
        starts, at = {}, 0
        for name, count in types:
            starts[name] = at
            at += count
        x = torch.cat([xs[name] for name, _ in types])
        edge_index = torch.cat(
            [e + torch.tensor([[starts[s]], [starts[t]]]) for (s, _, t), e in relations], dim=1
        )
        edge_type = torch.cat(
            [torch.full((e.shape[1],), r, dtype=torch.long) for r, (_, e) in enumerate(relations)]
        )
        convs = torch.nn.ModuleList(
            RGCNConv(dims[i], dims[i + 1], len(relations)) for i in range(args.layers)
        )
        first, end = starts[target], starts[target] + dict(types)[target]

        def forward(training):
            h = x
            for i, conv in enumerate(convs):
                h = F.dropout(h, p=args.dropout, training=training)
                h = conv(h, edge_index, edge_type)
                if i + 1 < len(convs):
                    h = F.relu(h)
            return h[first:end]

        params = convs.parameters()
    else:
        data = HeteroData()
        for name, _ in types:
            data[name].x = xs[name]
        for key, e in relations:
            data[key].edge_index = e

        def conv(i):
            if args.model == "heterosage":
                return SAGEConv((-1, -1), dims[i + 1], aggr="mean")
            # An int in_channels: one weight maps both ends' rows (GATConv's `lin`, as in the
            # MLPerf model); a tuple would give each end its own.
            if i + 1 < args.layers:
                return GATConv(dims[i], dims[i + 1] // args.heads, heads=args.heads,
                               dropout=args.dropout, add_self_loops=False)
            return GATConv(dims[i], dims[i + 1], heads=1, concat=False, dropout=args.dropout,
                           add_self_loops=False)

        class Stack(torch.nn.Module):
            def __init__(self):
                super().__init__()
                self.convs = torch.nn.ModuleList(conv(i) for i in range(args.layers))
                # A module, not F.dropout(training=self.training): to_hetero traces the
                # forward once, and a module's mode still follows train()/eval().
                self.drop = torch.nn.Dropout(args.dropout)

            def forward(self, h, edge_index):
                for i, conv in enumerate(self.convs):
                    h = self.drop(h)
                    h = conv(h, edge_index)
                    if i + 1 < len(self.convs):
                        h = h.relu()
                return h

        model = to_hetero(Stack(), data.metadata(), aggr="sum")
        with torch.no_grad():  # materialise the lazy weights
            model(data.x_dict, data.edge_index_dict)

        def forward(training):
            model.train(training)
            return model(data.x_dict, data.edge_index_dict)[target]

        params = model.parameters()

    opt = torch.optim.Adam(params, lr=args.lr)
    times, losses = [], []
    for epoch in range(args.epochs + 1):
        start = time.perf_counter()
        opt.zero_grad()
        out = forward(True)
        loss = F.cross_entropy(out[train], y[train])
        loss.backward()
        opt.step()
        elapsed = time.perf_counter() - start
        losses.append(loss.item())
        print(f"pyg {args.model} epoch {epoch}: loss {loss.item():.4f}, {elapsed:.4f}s", file=sys.stderr)
        if epoch > 0:  # the first epoch is warm-up, as in grandis
            times.append(elapsed)
    with torch.no_grad():
        pred = forward(False).argmax(dim=1)
    acc = lambda ids: (pred[ids] == y[ids]).float().mean().item()
    print(
        json.dumps(
            {
                "model": args.model,
                "median_epoch_s": statistics.median(times),
                "epoch_seconds": times,
                "peak_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
                "final_loss": losses[-1],
                "val_acc": acc(val),
                "test_acc": acc(test),
                "relations": [list(k) for k, _ in relations],
                "torch": torch.__version__,
                "torch_geometric": torch_geometric.__version__,
                "threads": torch.get_num_threads(),
            }
        )
    )


if __name__ == "__main__":
    main()
