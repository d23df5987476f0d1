//! GCN (Kipf & Welling): a layer computes `h' = Â h W + b` with the symmetric normalisation
//! `Â = D^-1/2 (A + I) D^-1/2` ([`crate::aggregation`] picks it), one weight and no self term.

use grandis_engine::{Backend, Result};

use crate::param::ParamBuilder;

/// The one weight of stage `s`, applied to the aggregated neighbourhood.
pub(super) fn layer_weights<B: Backend>(
    pb: &mut ParamBuilder<'_, B>,
    s: usize,
    d_in: usize,
    d_out: usize,
) -> Result<(Option<usize>, Option<usize>)> {
    Ok((None, Some(pb.linear(s, "weight", d_in, d_out)?)))
}
