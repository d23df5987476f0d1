//! GCN (Kipf & Welling): a layer computes `h' = Â h W + b` with the symmetric normalisation
//! `Â = D^-1/2 (A + I) D^-1/2` ([`crate::aggregation`] picks it), one weight and no self term.

use crate::param::ParamLayout;

/// The one weight of stage `s`, applied to the aggregated neighbourhood, and its bias:
/// Glorot and zero, like PyG's `GCNConv`.
pub(super) fn layer_weights(
    pb: &mut ParamLayout,
    s: usize,
    d_in: usize,
    d_out: usize,
) -> (Option<usize>, Option<usize>, usize) {
    (
        None,
        Some(pb.glorot(s, "weight", d_in, d_out)),
        pb.zero_bias(s, d_out),
    )
}
