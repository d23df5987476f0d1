//! One file per architecture. Each lays out the stages of its model and creates their
//! parameters through a [`ParamBuilder`] in a fixed order, so a seed fixes every initial
//! weight. Sage, GCN and the MLP are plain stacks that differ only in the weights of a layer;
//! ResSAGE+ has an encoder, res+ blocks and a head.

mod gcn;
mod mlp;
mod ressage;
mod sage;

use grandis_engine::{Backend, Result};

use crate::param::ParamBuilder;
use crate::stage::{Stage, StageKind};
use crate::{ModelConfig, ModelKind};

/// The stages of `c`'s architecture, their parameters created in `pb`.
pub(crate) fn stages<B: Backend>(
    pb: &mut ParamBuilder<'_, B>,
    c: &ModelConfig,
) -> Result<Vec<Stage>> {
    match c.kind {
        ModelKind::Sage => plain_stack(pb, c, sage::layer_weights),
        ModelKind::Gcn => plain_stack(pb, c, gcn::layer_weights),
        ModelKind::Mlp => plain_stack(pb, c, mlp::layer_weights),
        ModelKind::ResSage => ressage::stages(pb, c),
    }
}

/// The weights of one layer of a plain stack, created for stage `s` (`d_in x d_out`):
/// `(w_self, w_neigh)`, indices into the parameters.
type LayerWeights<B> =
    fn(&mut ParamBuilder<'_, B>, usize, usize, usize) -> Result<(Option<usize>, Option<usize>)>;

/// `c.layers` layers `in_dim -> hidden -> ... -> classes`: each drops out its input, applies
/// its weights and bias, and all but the last apply LayerNorm (if any) and ReLU after.
fn plain_stack<B: Backend>(
    pb: &mut ParamBuilder<'_, B>,
    c: &ModelConfig,
    weights: LayerWeights<B>,
) -> Result<Vec<Stage>> {
    let mut stages = Vec::with_capacity(c.layers);
    for l in 0..c.layers {
        let s = stages.len();
        let d_in = if l == 0 { c.in_dim } else { c.hidden };
        let last = l + 1 == c.layers;
        let d_out = if last { c.classes } else { c.hidden };
        let (w_self, w_neigh) = weights(pb, s, d_in, d_out)?;
        let bias = pb.bias(s, d_out)?;
        let (gamma, beta) = if last {
            (None, None)
        } else {
            pb.norm(s, d_out)?
        };
        stages.push(Stage {
            kind: StageKind::Conv {
                pre: false,
                post: !last,
                residual: false,
            },
            d_in,
            d_out,
            w_self,
            w_neigh,
            bias,
            gamma,
            beta,
        });
    }
    Ok(stages)
}
