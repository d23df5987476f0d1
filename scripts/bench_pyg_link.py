#!/usr/bin/env python3
"""PyG's link prediction (the protocol of PyG's examples/link_pred.py) on a link split that
`grandis bench train --task link` exported (the PyG layout of `grandis data export`, with the
split's link_*.npy pairs): a GCNConv or SAGEConv encoder (ReLU between layers, dropout at
--dropout), a dot-product decoder, Adam, binary cross-entropy over the training positives and
as many negatives per epoch from torch_geometric.utils.negative_sampling. The adjacency is
PyG's fastest CPU input, a CSR `adj_t` (on --device cuda:N, the same on that GPU). After the last epoch it scores the exported
validation and test positives against their negatives (AUC, ties counting half; the test
edges' MRR and Hits@10/50 with OGB's evaluator semantics, as grandis scores them) and prints
one JSON line: val_auc, test_auc, test_mrr, test_hits_at_10, test_hits_at_50, median_epoch_s, epoch_seconds (the first epoch is warm-up,
as in grandis), peak_rss_bytes, losses and the versions. With --embedding-dim D every vertex
also has D learnable input columns after its features (a torch.nn.Embedding, N(0, 1) as
torch initialises it, trained with SparseAdam at --lr, as grandis trains its table). With
--decoder mlp a pair's score is PyG's link examples' MLP on z_u * z_v (Linear(d, d), ReLU,
Linear(d, 1)), trained with the encoder.

A typed dataset (its export has hetero.json: the HeteroData layout of grandis's typed npy
export, with the link split's pairs in global ids and the relation they belong to) trains
--model rgcn (RGCNConv over the homogeneous graph with edge types) or heterosage (to_hetero of
a SAGEConv stack, aggr="sum"), each type's input its features zero-padded to the widest type,
then its embedding columns; the outputs are concatenated in type order (global ids), and
training negatives corrupt each positive's destination within the relation's destination type
(as grandis draws them)."""

import argparse
import json
import os
import resource
import statistics
import sys
import time


def auc(pos, neg):
    """The Mann-Whitney statistic: P(a positive outscores a negative), ties counting half."""
    import numpy as np

    neg = np.sort(neg)
    below = np.searchsorted(neg, pos, side="left")
    upto = np.searchsorted(neg, pos, side="right")
    return float((below + 0.5 * (upto - below)).sum() / (len(pos) * len(neg)))


def hits_at(pos, neg, k):
    """OGB's Hits@K: the fraction of positives scored strictly above the K-th highest
    negative (1 with fewer than K negatives)."""
    import numpy as np

    if len(neg) < k:
        return 1.0
    kth = np.sort(neg)[::-1][k - 1]
    return float((pos > kth).mean())


def mrr(pos, neg):
    """OGB's MRR: positive i ranked among its own negatives neg[i k:(i + 1) k], ties ranked
    half-way between the optimistic and the pessimistic rank."""
    import numpy as np

    if len(pos) == 0 or len(neg) == 0 or len(neg) % len(pos):
        return float("nan")
    negs = neg.reshape(len(pos), -1)
    optimistic = (negs >= pos[:, None]).sum(axis=1)
    pessimistic = (negs > pos[:, None]).sum(axis=1)
    return float((1.0 / (0.5 * (optimistic + pessimistic) + 1.0)).mean())


def load_typed(d, load, dev):
    """The typed export as one graph: features padded to the widest type and concatenated in
    type order, every relation's edges in global ids with their edge type, each type's id
    range, and the id range of the link relation's destination type."""
    import torch
    import torch.nn.functional as F

    with open(os.path.join(d, "hetero.json")) as f:
        meta = json.load(f)
    ranges, at = {}, 0
    for t in meta["node_types"]:
        ranges[t["name"]] = (at, at + t["count"])
        at += t["count"]
    xs = {}
    for name, (lo, hi) in ranges.items():
        path = os.path.join(d, f"x_{name}.npy")
        xs[name] = load(f"x_{name}.npy").float() if os.path.exists(path) else torch.zeros(hi - lo, 0, device=dev)
    width = max(x.shape[1] for x in xs.values())
    x = torch.cat([F.pad(xs[name], (0, width - xs[name].shape[1])) for name in ranges])
    relations, edges, types = [], [], []
    for f in sorted(os.listdir(d)):
        if f.startswith("edge_index_") and f.endswith(".npy"):
            src, rel, dst = f[len("edge_index_"):-len(".npy")].split("__")
            e = load(f) + torch.tensor([[ranges[src][0]], [ranges[dst][0]]], device=dev)
            types.append(torch.full((e.shape[1],), len(relations), dtype=torch.long, device=dev))
            relations.append((src, rel, dst))
            edges.append(e)
    dst = meta["link_relation"].split("__")[2]
    return x, torch.cat(edges, dim=1), torch.cat(types), relations, ranges, ranges[dst]


def typed_sage(args, dims, relations, ranges, x, edge_index, edge_type, dev):
    """to_hetero of a SAGEConv stack (aggr="sum") as a module from the global input rows to
    the global output rows (types concatenated in id order)."""
    import torch
    from torch_geometric.nn import SAGEConv, to_hetero

    class Stack(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.convs = torch.nn.ModuleList(
                SAGEConv((-1, -1), dims[i + 1], aggr="mean") for i in range(args.layers))
            # A module, so that to_hetero's traced forward follows train()/eval().
            self.drop = torch.nn.Dropout(args.dropout)

        def forward(self, h, edge_index):
            for i, conv in enumerate(self.convs):
                h = conv(self.drop(h), edge_index)
                if i + 1 < len(self.convs):
                    h = h.relu()
            return h

    local = {}
    for r, (src, rel, dst) in enumerate(relations):
        e = edge_index[:, edge_type == r]
        local[(src, rel, dst)] = e - torch.tensor([[ranges[src][0]], [ranges[dst][0]]], device=dev)
    metadata = (list(ranges), list(local))
    hetero = to_hetero(Stack(), metadata, aggr="sum").to(dev)

    class Global(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.hetero = hetero

        def forward(self, h):
            out = self.hetero({t: h[lo:hi] for t, (lo, hi) in ranges.items()}, local)
            return torch.cat([out[t] for t in ranges])

    model = Global()
    with torch.no_grad():  # materialise the lazy weights
        model(torch.zeros(x.shape[0], dims[0], device=dev))
    return model


def main():
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--dir", required=True)
    ap.add_argument("--model", choices=["gcn", "sage", "rgcn", "heterosage"], default="gcn")
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--hidden", type=int, default=128)
    ap.add_argument("--out-dim", type=int, default=64)
    ap.add_argument("--dropout", type=float, default=0.0)
    ap.add_argument("--lr", type=float, default=0.01)
    ap.add_argument("--weight-decay", type=float, default=0.0)
    ap.add_argument("--epochs", type=int, default=100)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--embedding-dim", type=int, default=0)
    ap.add_argument("--decoder", choices=["dot", "mlp"], default="dot")
    ap.add_argument("--device", default="cpu",
                    help="cpu or cuda:N: where the model, the graph and the features live")
    ap.add_argument("--train-negatives", choices=["pyg", "corrupt"], default="pyg",
                    help="pyg: negative_sampling (random pairs avoiding edges, the example's); "
                         "corrupt: each training edge's source with a uniform destination, as "
                         "grandis draws them")
    args = ap.parse_args()

    import numpy as np
    import torch
    import torch.nn.functional as F
    import torch_geometric
    from torch_geometric.nn import GCNConv, RGCNConv, SAGEConv
    from torch_geometric.utils import negative_sampling, to_torch_csr_tensor

    torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)
    dev = torch.device(args.device)
    cuda = dev.type == "cuda"
    load = lambda name: torch.from_numpy(np.load(os.path.join(args.dir, name))).to(dev)
    typed = os.path.exists(os.path.join(args.dir, "hetero.json"))
    if typed:
        x, edge_index, edge_type, relations, ranges, dst_range = load_typed(args.dir, load, dev)
    else:
        x = load("x.npy")
        edge_index = load("edge_index.npy")
    train_pos = load("link_train.npy")
    n = x.shape[0]
    adj = to_torch_csr_tensor(edge_index.flip(0), size=(n, n))

    emb = None
    if args.embedding_dim > 0:
        emb = torch.nn.Embedding(n, args.embedding_dim, sparse=True).to(dev)
        emb_opt = torch.optim.SparseAdam(emb.parameters(), lr=args.lr)
    dims = [x.shape[1] + args.embedding_dim] + [args.hidden] * (args.layers - 1) + [args.out_dim]
    if args.model == "heterosage":
        convs = typed_sage(args, dims, relations, ranges, x, edge_index, edge_type, dev)
    else:
        conv = {
            "gcn": lambda i: GCNConv(dims[i], dims[i + 1]),
            "sage": lambda i: SAGEConv(dims[i], dims[i + 1], aggr="mean"),
            "rgcn": lambda i: RGCNConv(dims[i], dims[i + 1], len(relations)),
        }[args.model]
        convs = torch.nn.ModuleList(conv(i) for i in range(args.layers)).to(dev)
    # The MLP decoder of PyG's link examples: Linear(d, d), ReLU, Linear(d, 1) on z_u * z_v.
    mlp = None
    params = list(convs.parameters())
    if args.decoder == "mlp":
        d = args.out_dim
        mlp = torch.nn.Sequential(torch.nn.Linear(d, d), torch.nn.ReLU(), torch.nn.Linear(d, 1)).to(dev)
        params += list(mlp.parameters())
    opt = torch.optim.Adam(params, lr=args.lr, weight_decay=args.weight_decay)

    def decode(z, pairs):
        h = z[pairs[0]] * z[pairs[1]]
        return h.sum(dim=-1) if mlp is None else mlp(h).squeeze(-1)

    every = torch.arange(n, device=dev)

    def encode(training):
        h = x if emb is None else torch.cat([x, emb(every)], dim=1)
        if args.model == "heterosage":
            convs.train(training)
            return convs(h)
        for i, c in enumerate(convs):
            h = F.dropout(h, p=args.dropout, training=training)
            h = c(h, edge_index, edge_type) if args.model == "rgcn" else c(h, adj)
            if i + 1 < len(convs):
                h = F.relu(h)
        return h

    times, losses = [], []
    for epoch in range(args.epochs + 1):
        start = time.perf_counter()
        convs.train()
        opt.zero_grad()
        if emb is not None:
            emb_opt.zero_grad()
        z = encode(True)
        if typed:
            lo, hi = dst_range
            neg = torch.stack([train_pos[0], torch.randint(lo, hi, (train_pos.size(1),), device=dev)])
        elif args.train_negatives == "pyg":
            neg = negative_sampling(edge_index=edge_index, num_nodes=n,
                                    num_neg_samples=train_pos.size(1), method="sparse")
        else:
            neg = torch.stack([train_pos[0], torch.randint(0, n, (train_pos.size(1),), device=dev)])
        pairs = torch.cat([train_pos, neg], dim=1)
        labels = torch.cat([torch.ones(train_pos.size(1), device=dev),
                            torch.zeros(neg.size(1), device=dev)])
        out = decode(z, pairs)
        loss = F.binary_cross_entropy_with_logits(out, labels)
        loss.backward()
        opt.step()
        if emb is not None:
            emb_opt.step()
        loss_value = loss.item()  # waits for the device, so the epoch is timed whole
        elapsed = time.perf_counter() - start
        losses.append(loss_value)
        if epoch > 0:
            times.append(elapsed)
    convs.eval()
    with torch.no_grad():
        z = encode(False)
        score = lambda name: decode(z, load(name)).cpu().numpy()
        val_auc = auc(score("link_valid_pos.npy"), score("link_valid_neg.npy"))
        test_pos, test_neg = score("link_test_pos.npy"), score("link_test_neg.npy")
        test_auc = auc(test_pos, test_neg)
    print(json.dumps({
        "val_auc": val_auc,
        "test_auc": test_auc,
        "test_mrr": mrr(test_pos, test_neg),
        "test_hits_at_10": hits_at(test_pos, test_neg, 10),
        "test_hits_at_50": hits_at(test_pos, test_neg, 50),
        "median_epoch_s": statistics.median(times) if times else None,
        "epoch_seconds": times,
        "peak_rss_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
        **({"peak_device_bytes": torch.cuda.max_memory_allocated(dev)} if cuda else {}),
        "losses": losses,
        "torch": torch.__version__,
        "torch_geometric": torch_geometric.__version__,
    }))


if __name__ == "__main__":
    try:
        main()
    except Exception as e:  # one JSON line either way, so the caller can report it
        print(json.dumps({"error": f"{type(e).__name__}: {e}"}))
        sys.exit(1)
