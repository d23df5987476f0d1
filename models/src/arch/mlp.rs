//! The features-only MLP baseline: a layer computes `h' = h W + b` and reads no neighbour, so
//! it needs no halo (and no partition-parallel mode runs it).

use super::{Layer, LayerParams};
use crate::param::ParamLayout;
use crate::ModelConfig;

/// The one weight of stage `s`, applied to the vertex's own row, and its bias (a `Linear`).
pub(super) fn layer_weights(pb: &mut ParamLayout, _c: &ModelConfig, l: &Layer) -> LayerParams {
    LayerParams {
        w_self: Some(pb.linear(l.s, "weight", l.d_in, l.d_out)),
        w_neigh: None,
        bias: Some(pb.bias(l.s, l.d_out, l.d_in)),
        attention: None,
        relations: Vec::new(),
        bases: None,
    }
}
