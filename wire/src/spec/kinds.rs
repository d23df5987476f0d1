//! The named choices of a job (model, mode, partitioner, priority, transport): each parses
//! from and prints as the one name users write.

use std::fmt;

use serde::{Deserialize, Serialize};

/// Graph neural network architecture.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum ModelKind {
    /// GraphSAGE (Hamilton et al., mean aggregator): `W_self h_v + W_neigh mean_{u in N(v)} h_u + b`.
    Sage,
    /// GCN (Kipf & Welling, symmetric normalisation): `D^-1/2 (A + I) D^-1/2 H W + b`.
    Gcn,
    /// ResSAGE+ (DeeperGCN `res+` blocks over SAGE convolutions), for deep GNNs: encoder,
    /// SAGE conv, then `h + conv(dropout(relu(norm(h))))` blocks and a
    /// `norm -> relu -> dropout -> linear` head.
    ResSage,
    /// Features only (`W h_v + b` per layer): the no-graph baseline (single mode only).
    Mlp,
    /// GAT (Veličković et al., PyG `GATConv` semantics): `heads` attention heads per hidden
    /// layer, concatenated (`hidden / heads` columns each), `output_heads` averaged in the
    /// last; LeakyReLU(0.2) logits over in-neighbours plus one self-loop, attention dropout
    /// at `dropout`.
    Gat,
    /// R-GCN (Schlichtkrull et al., PyG `RGCNConv` semantics) on a typed dataset:
    /// `W_root h_v + b + sum_r W_r mean_{u in N_r(v)} h_u`, one weight per relation.
    Rgcn,
    /// GraphSAGE per relation, summed (PyG's `to_hetero` / `HeteroConv(aggr="sum")` over
    /// `SAGEConv`) on a typed dataset: `sum_{r into type(v)} (W_self,r h_v + W_neigh,r
    /// mean_{u in N_r(v)} h_u + b_r)`.
    HeteroSage,
    /// R-GAT: GAT per relation, summed (PyG's `to_hetero` / `HeteroConv(aggr="sum")` over
    /// `GATConv(add_self_loops=False)`, the MLPerf GNN benchmark's model) on a typed dataset:
    /// each relation its own weight, attention vectors and bias; a vertex attends to its
    /// relation's in-neighbours only (no self-loop), `heads` / `output_heads` as in gat.
    Rgat,
}

impl ModelKind {
    /// Whether the model reads a typed dataset's relations (and needs one).
    pub fn is_typed(self) -> bool {
        matches!(
            self,
            ModelKind::Rgcn | ModelKind::HeteroSage | ModelKind::Rgat
        )
    }

    /// Whether the model attends over its neighbours with `heads` heads (`output_heads` in
    /// the last layer).
    pub fn uses_attention(self) -> bool {
        matches!(self, ModelKind::Gat | ModelKind::Rgat)
    }
}

/// What a job trains its model for.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Task {
    /// Node classification: a class per labelled vertex (cross-entropy; accuracy).
    #[default]
    Node,
    /// Link prediction: a score per vertex pair, the dot product of the two ends' embeddings
    /// (binary cross-entropy over the dataset's link split and sampled negatives; AUC, MRR,
    /// Hits@K). The dataset needs a link split (`grandis data split-edges`).
    Link,
}

impl Task {
    pub fn is_node(&self) -> bool {
        *self == Task::Node
    }
}

/// How link prediction scores a pair from its ends' embeddings.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum LinkDecoder {
    /// The dot product of the two embeddings.
    #[default]
    Dot,
    /// An MLP on their Hadamard product: Linear(d, d), ReLU, Linear(d, 1) (PyG's
    /// `LinkPredictor`), trained with the encoder.
    Mlp,
}

impl LinkDecoder {
    pub fn is_dot(&self) -> bool {
        *self == LinkDecoder::Dot
    }
}

/// How the training is distributed (GraNNDIS §5).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Mode {
    /// One process, one device: the exact reference trainer.
    Single,
    /// Distributed full batch without preloading (the FB baseline).
    Fb,
    /// Full batch with flexible preloading of `preload_hops` hops (§5.1).
    Flx,
    /// Mini-batch with cooperative batching: one co-batch per server (§5.2).
    Cob,
    /// Conventional distributed mini-batch: one mini-batch per device (the MB baseline).
    Mb,
    /// GraphTheta's cluster batches: each iteration trains on a union of small METIS clusters,
    /// neighbours restricted to the batch (as Cluster-GCN).
    Cluster,
    /// Let the runtime choose from the memory model (`device_memory`).
    Auto,
}

/// What carries a job's traffic between servers (halo rows, the heads' all-reduce).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum InterTransport {
    /// The daemons' data plane: QUIC with mutual TLS (the in-process fabric inside `grandis
    /// train`); device rows are staged through host memory.
    #[default]
    Quic,
    /// NCCL across servers (InfiniBand / RoCE clusters): device buffers straight to the NIC.
    /// Needs CUDA ranks on distinct devices; the communicator's id travels over the data plane.
    Nccl,
}

/// How vertices are split over servers and devices (at both levels).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum PartitionMethod {
    /// METIS k-way, vertex weights `[1, is_train]`.
    Metis,
    /// SPRING streaming partitioning (CATGNN Algorithm 1).
    Spring,
    /// Seeded uniform random assignment.
    Random,
    /// ByteGNN's block partitioning: multi-hop neighbourhood blocks around the train,
    /// validation and test vertices, assigned balancing each split (sampling locality).
    Bytegnn,
}

/// How expansion-aware sampling picks among external candidates.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Priority {
    /// Greedy: most edges into unsaturated frontier vertices first (the paper).
    #[default]
    Degree,
    /// Seeded uniform choice per vertex (the published artifact).
    Uniform,
}

macro_rules! named_enum {
    ($ty:ident, $expected:literal, [$($variant:ident => $name:literal),+ $(,)?]) => {
        impl $ty {
            pub const ALL: &'static [$ty] = &[$($ty::$variant),+];
            /// Human-readable list of the accepted names, for error messages.
            pub const EXPECTED: &'static str = $expected;
            pub fn name(self) -> &'static str {
                match self { $($ty::$variant => $name),+ }
            }
            pub fn parse(s: &str) -> Option<$ty> {
                match s { $($name => Some($ty::$variant),)+ _ => None }
            }
        }
        impl fmt::Display for $ty {
            fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                f.write_str(self.name())
            }
        }
        impl std::str::FromStr for $ty {
            type Err = UnknownName;
            fn from_str(s: &str) -> Result<$ty, UnknownName> {
                $ty::parse(s).ok_or_else(|| UnknownName {
                    given: s.to_string(),
                    expected: $expected,
                })
            }
        }
    };
}

/// A name that is none of an enum's accepted names (`"unknown 'x' (expected a, b or c)"`).
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
#[error("unknown '{given}' (expected {expected})")]
pub struct UnknownName {
    pub given: String,
    pub expected: &'static str,
}

named_enum!(ModelKind, "sage, gcn, ressage, mlp, gat, rgcn, heterosage or rgat", [
    Sage => "sage", Gcn => "gcn", ResSage => "ressage", Mlp => "mlp", Gat => "gat",
    Rgcn => "rgcn", HeteroSage => "heterosage", Rgat => "rgat"
]);
named_enum!(Mode, "single, fb, flx, cob, mb, cluster or auto", [
    Single => "single", Fb => "fb", Flx => "flx", Cob => "cob", Mb => "mb",
    Cluster => "cluster", Auto => "auto"
]);
named_enum!(PartitionMethod, "metis, spring, random or bytegnn", [
    Metis => "metis", Spring => "spring", Random => "random", Bytegnn => "bytegnn"
]);
named_enum!(Priority, "degree or uniform", [Degree => "degree", Uniform => "uniform"]);
named_enum!(Task, "node or link", [Node => "node", Link => "link"]);
named_enum!(LinkDecoder, "dot or mlp", [Dot => "dot", Mlp => "mlp"]);
named_enum!(InterTransport, "quic or nccl", [Quic => "quic", Nccl => "nccl"]);

impl Mode {
    /// The modes that run on servers × devices ranks, as messages list them.
    pub const DISTRIBUTED_NAMES: &'static str = "fb, flx, cob, mb, cluster and auto";

    /// Modes that train on mini-batches (and so use `batch_size`).
    pub fn is_mini_batch(self) -> bool {
        matches!(self, Mode::Cob | Mode::Mb | Mode::Cluster)
    }

    /// Modes that run on servers × devices ranks (all but `single`).
    pub fn is_distributed(self) -> bool {
        self != Mode::Single
    }
}
