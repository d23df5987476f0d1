//! GraphSAGE with the mean aggregator (Hamilton et al.): a layer computes
//! `h' = h W_self + mean_{u in N(v)} h_u W_neigh + b`.

use crate::param::ParamLayout;

/// `W_self`, `W_neigh` and `b` of stage `s`, initialised like PyG's `SAGEConv`: two
/// `Linear`s, the bias on the neighbour map's (`lin_l`).
pub(super) fn layer_weights(
    pb: &mut ParamLayout,
    s: usize,
    d_in: usize,
    d_out: usize,
) -> (Option<usize>, Option<usize>, usize) {
    (
        Some(pb.linear(s, "w_self", d_in, d_out)),
        Some(pb.linear(s, "w_neigh", d_in, d_out)),
        pb.bias(s, d_out, d_in),
    )
}
