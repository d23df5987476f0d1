//! R-GCN (Schlichtkrull et al.) with PyG `RGCNConv` semantics on a typed dataset: a layer
//! computes `h' = h W_root + b + sum_r mean_{u in N_r(v)} h_u W_r`, one weight per relation
//! and one root weight and bias for every vertex type (the features of every type are as
//! wide as the widest). With `num_bases` B, `W_r = sum_b comp[r, b] basis[b]` (PyG's
//! `num_bases`): B shared `d_in x d_out` bases and an `R x B` matrix of coefficients.
//! Initialisation is PyG's: Glorot weights (bases), coefficients and root, zero bias.

use super::{Layer, LayerParams};
use crate::param::ParamLayout;
use crate::stage::{RelationBases, RelationWeights};
use crate::ModelConfig;

pub(super) fn layer_weights(pb: &mut ParamLayout, c: &ModelConfig, l: &Layer) -> LayerParams {
    let bases = c.num_bases.map(|count| RelationBases {
        basis: pb.glorot_stack(l.s, "basis", count, l.d_in, l.d_out),
        comp: pb.glorot(l.s, "comp", c.relations.len(), count),
        count,
    });
    let relations = c
        .relations
        .iter()
        .map(|r| RelationWeights {
            w_neigh: match bases {
                Some(_) => None,
                None => Some(pb.glorot(l.s, &format!("{}.weight", r.key), l.d_in, l.d_out)),
            },
            w_self: None,
            bias: None,
            attention: None,
            src_type: r.src_type,
            dst_type: r.dst_type,
        })
        .collect();
    LayerParams {
        w_self: Some(pb.glorot(l.s, "root", l.d_in, l.d_out)),
        w_neigh: None,
        bias: Some(pb.zero_bias(l.s, l.d_out)),
        attention: None,
        relations,
        bases,
    }
}
