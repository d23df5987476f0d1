//! The features-only MLP baseline: a layer computes `h' = h W + b` and reads no neighbour, so
//! it needs no halo (and no partition-parallel mode runs it).

use crate::param::ParamLayout;

/// The one weight of stage `s`, applied to the vertex's own row, and its bias (a `Linear`).
pub(super) fn layer_weights(
    pb: &mut ParamLayout,
    s: usize,
    d_in: usize,
    d_out: usize,
) -> (Option<usize>, Option<usize>, usize) {
    (
        Some(pb.linear(s, "weight", d_in, d_out)),
        None,
        pb.bias(s, d_out, d_in),
    )
}
