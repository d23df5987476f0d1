//! GraphSAGE per relation, summed: PyG's `to_hetero` of a `SAGEConv` stack (equivalently
//! `HeteroConv({r: SAGEConv}, aggr="sum")`) on a typed dataset. Relation `r` into type `t`
//! has its own `SAGEConv`: `h_v W_self,r + mean_{u in N_r(v)} h_u W_neigh,r + b_r` for every
//! vertex `v` of type `t` (its root term counts whether or not `v` has `r`-neighbours), and
//! a vertex's output is the sum over the relations into its type; a type no relation enters
//! outputs zeros (PyG drops it).

use super::{Layer, LayerParams};
use crate::param::ParamLayout;
use crate::stage::RelationWeights;
use crate::ModelConfig;

/// Each relation's `W_self`, `W_neigh` and bias, initialised like PyG's `SAGEConv` (two
/// `Linear`s, the bias on the neighbour map's), in the relations' order.
pub(super) fn layer_weights(pb: &mut ParamLayout, c: &ModelConfig, l: &Layer) -> LayerParams {
    let relations = c
        .relations
        .iter()
        .map(|r| RelationWeights {
            w_self: Some(pb.linear(l.s, &format!("{}.w_self", r.key), l.d_in, l.d_out)),
            w_neigh: Some(pb.linear(l.s, &format!("{}.w_neigh", r.key), l.d_in, l.d_out)),
            bias: Some(pb.named_bias(l.s, &format!("{}.bias", r.key), l.d_out, l.d_in)),
            attention: None,
            src_type: r.src_type,
            dst_type: r.dst_type,
        })
        .collect();
    LayerParams::of_relations(relations)
}
