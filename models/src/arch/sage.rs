//! GraphSAGE with the mean aggregator (Hamilton et al.): a layer computes
//! `h' = h W_self + mean_{u in N(v)} h_u W_neigh + b`.

use super::{Layer, LayerParams};
use crate::param::ParamLayout;
use crate::ModelConfig;

/// `W_self`, `W_neigh` and `b` of stage `s`, initialised like PyG's `SAGEConv`: two
/// `Linear`s, the bias on the neighbour map's (`lin_l`).
pub(super) fn layer_weights(pb: &mut ParamLayout, _c: &ModelConfig, l: &Layer) -> LayerParams {
    LayerParams {
        w_self: Some(pb.linear(l.s, "w_self", l.d_in, l.d_out)),
        w_neigh: Some(pb.linear(l.s, "w_neigh", l.d_in, l.d_out)),
        bias: Some(pb.bias(l.s, l.d_out, l.d_in)),
        attention: None,
        relations: Vec::new(),
        bases: None,
    }
}
