//! The features-only MLP baseline: a layer computes `h' = h W + b` and reads no neighbour, so
//! it needs no halo (and no partition-parallel mode runs it).

use grandis_engine::{Backend, Result};

use crate::param::ParamBuilder;

/// The one weight of stage `s`, applied to the vertex's own row.
pub(super) fn layer_weights<B: Backend>(
    pb: &mut ParamBuilder<'_, B>,
    s: usize,
    d_in: usize,
    d_out: usize,
) -> Result<(Option<usize>, Option<usize>)> {
    Ok((Some(pb.linear(s, "weight", d_in, d_out)?), None))
}
