//! GCN (Kipf & Welling): a layer computes `h' = Â h W + b` with the symmetric normalisation
//! `Â = D^-1/2 (A + I) D^-1/2` ([`crate::aggregation`] picks it), one weight and no self term.

use super::{Layer, LayerParams};
use crate::param::ParamLayout;
use crate::ModelConfig;

/// The one weight of stage `s`, applied to the aggregated neighbourhood, and its bias:
/// Glorot and zero, like PyG's `GCNConv`.
pub(super) fn layer_weights(pb: &mut ParamLayout, _c: &ModelConfig, l: &Layer) -> LayerParams {
    LayerParams {
        w_self: None,
        w_neigh: Some(pb.glorot(l.s, "weight", l.d_in, l.d_out)),
        bias: Some(pb.zero_bias(l.s, l.d_out)),
        attention: None,
        relations: Vec::new(),
        bases: None,
    }
}
