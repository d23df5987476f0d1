//! GraphSAGE with the mean aggregator (Hamilton et al.): a layer computes
//! `h' = h W_self + mean_{u in N(v)} h_u W_neigh + b`.

use crate::param::ParamLayout;

/// `W_self` and `W_neigh` of stage `s`.
pub(super) fn layer_weights(
    pb: &mut ParamLayout,
    s: usize,
    d_in: usize,
    d_out: usize,
) -> (Option<usize>, Option<usize>) {
    (
        Some(pb.linear(s, "w_self", d_in, d_out)),
        Some(pb.linear(s, "w_neigh", d_in, d_out)),
    )
}
