//! R-GCN (Schlichtkrull et al.) with PyG `RGCNConv` semantics on a typed dataset: a layer
//! computes `h' = h W_root + b + sum_r mean_{u in N_r(v)} h_u W_r`, one weight per relation
//! and one root weight and bias for every vertex type (the features of every type are as
//! wide as the widest). Initialisation is PyG's: Glorot weights and root, zero bias.

use super::{Layer, LayerParams};
use crate::param::ParamLayout;
use crate::stage::RelationWeights;
use crate::ModelConfig;

pub(super) fn layer_weights(pb: &mut ParamLayout, c: &ModelConfig, l: &Layer) -> LayerParams {
    let relations = c
        .relations
        .iter()
        .map(|r| RelationWeights {
            w_neigh: pb.glorot(l.s, &format!("{}.weight", r.key), l.d_in, l.d_out),
            w_self: None,
            bias: None,
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
    }
}
