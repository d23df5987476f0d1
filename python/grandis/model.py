"""A grandis checkpoint as a PyTorch / PyG module (`to_pyg`), so a trained model is served or
fine-tuned in PyTorch. Needs `torch` and `torch_geometric` (`pip install ./python[pyg]`).

The layers are PyG's own (`SAGEConv`, `GCNConv`, `GATConv`, `Linear`) with grandis's
weights, stacked as grandis stacks them: each layer drops out its input, applies the
convolution and, except the last, LayerNorm (when the model has it) and ReLU. The graph is
`edge_index` as PyG takes it (row 0 the sources, row 1 the destinations; grandis aggregates
over in-edges, as PyG does). ResSAGE+ has no PyG counterpart and is refused."""

from __future__ import annotations

import json
import os
from typing import Any, Dict, Tuple, Union

import numpy as np

META_KEY = "grandis"
FORMAT = "grandis-checkpoint-v1"
LN_EPS = 1e-5

PathLike = Union[str, os.PathLike]


def read_checkpoint(path: PathLike) -> Tuple[Dict[str, Any], Dict[str, np.ndarray]]:
    """A checkpoint's metadata (`model`, `train`, `epochs_done`, ...) and its tensors (the
    parameters by name, `stage{s}.{name}`, with an optimizer state `adam_m.*` /
    `adam_v.*`, and for a model with learnable node embeddings their table `node_embedding`,
    vertices x dim: the model's input is `np.hstack([x, node_embedding])`), as NumPy arrays."""
    from safetensors import safe_open

    with safe_open(os.fspath(path), framework="np") as f:
        meta = f.metadata() or {}
        if META_KEY not in meta:
            raise ValueError(f"{path}: not a grandis checkpoint (no '{META_KEY}' metadata)")
        info = json.loads(meta[META_KEY])
        if info.get("format") != FORMAT:
            raise ValueError(f"{path}: checkpoint format {info.get('format')!r}, "
                             f"expected {FORMAT!r}")
        tensors = {k: f.get_tensor(k) for k in f.keys()}
    return info, tensors


def to_pyg(checkpoint: PathLike):
    """The model of `checkpoint` as a `torch.nn.Module` whose `forward(x, edge_index)`
    returns the logits grandis computes (in `eval()` mode: dropout off)."""
    import torch
    from torch_geometric.nn import GATConv, GCNConv, SAGEConv

    info, tensors = read_checkpoint(checkpoint)
    cfg = info["model"]
    kind = cfg["kind"]
    if kind == "ressage":
        raise NotImplementedError("ResSAGE+ has no PyG counterpart; to_pyg takes sage, gcn, "
                                  "gat and mlp models")
    if kind in ("rgcn", "heterosage"):
        raise NotImplementedError(f"to_pyg does not build typed models ({kind}) yet; "
                                  "`grandis predict` writes their outputs")
    layers, hidden, classes = int(cfg["layers"]), int(cfg["hidden"]), int(cfg["classes"])

    def t(name: str) -> "torch.Tensor":
        if name not in tensors:
            raise ValueError(f"{checkpoint}: no tensor {name!r} for a {kind} model")
        return torch.from_numpy(np.ascontiguousarray(tensors[name]))

    convs, norms = [], []
    for s in range(layers):
        d_in = int(cfg["in_dim"]) if s == 0 else hidden
        last = s + 1 == layers
        d_out = classes if last else hidden
        p = f"stage{s}."
        if kind == "sage":
            conv = SAGEConv(d_in, d_out, aggr="mean", root_weight=True, bias=True)
            conv.lin_l.weight.data = t(p + "w_neigh").T.contiguous()
            conv.lin_l.bias.data = t(p + "bias")
            conv.lin_r.weight.data = t(p + "w_self").T.contiguous()
        elif kind == "gcn":
            conv = GCNConv(d_in, d_out, add_self_loops=True, normalize=True, bias=True)
            conv.lin.weight.data = t(p + "weight").T.contiguous()
            conv.bias.data = t(p + "bias")
        elif kind == "gat":
            heads = int(cfg.get("output_heads", 1)) if last else int(cfg.get("heads", 1))
            head_dim = d_out if last else d_out // heads
            conv = GATConv(d_in, head_dim, heads=heads, concat=not last, negative_slope=0.2,
                           dropout=float(cfg["dropout"]), add_self_loops=True, bias=True)
            lin = getattr(conv, "lin", None) or conv.lin_src
            lin.weight.data = t(p + "weight").T.contiguous()
            conv.att_src.data = t(p + "att_src").reshape(1, heads, head_dim)
            conv.att_dst.data = t(p + "att_dst").reshape(1, heads, head_dim)
            conv.bias.data = t(p + "bias")
        elif kind == "mlp":
            conv = torch.nn.Linear(d_in, d_out)
            conv.weight.data = t(p + "weight").T.contiguous()
            conv.bias.data = t(p + "bias")
        else:
            raise NotImplementedError(f"model kind {kind!r}")
        convs.append(conv)
        if not last and cfg.get("layer_norm"):
            norm = torch.nn.LayerNorm(d_out, eps=LN_EPS)
            norm.weight.data = t(p + "ln_gamma")
            norm.bias.data = t(p + "ln_beta")
            norms.append(norm)
        else:
            norms.append(None)
    return _Stack(convs, norms, float(cfg["dropout"]), reads_graph=kind != "mlp").eval()


def _Stack(convs, norms, dropout: float, reads_graph: bool):
    import torch
    import torch.nn.functional as F

    class GrandisModel(torch.nn.Module):
        """grandis's plain stack: dropout, convolution, then LayerNorm and ReLU but last."""

        def __init__(self):
            super().__init__()
            self.convs = torch.nn.ModuleList(convs)
            self.norms = torch.nn.ModuleList(
                [n if n is not None else torch.nn.Identity() for n in norms]
            )
            self.dropout = dropout
            self.reads_graph = reads_graph

        def forward(self, x, edge_index=None):
            for i, conv in enumerate(self.convs):
                x = F.dropout(x, p=self.dropout, training=self.training)
                x = conv(x, edge_index) if self.reads_graph else conv(x)
                if i + 1 < len(self.convs):
                    x = F.relu(self.norms[i](x))
            return x

    return GrandisModel()
