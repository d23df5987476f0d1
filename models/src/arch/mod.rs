//! One file per architecture. Each lays out the stages of its model and declares their
//! parameters in a [`ParamLayout`] in a fixed order, so a seed fixes every initial weight and
//! the shapes are known without a backend. Sage, GCN and the MLP are plain stacks that differ only in the weights of a layer;
//! ResSAGE+ has an encoder, res+ blocks and a head.

mod gcn;
mod mlp;
mod ressage;
mod sage;

use crate::param::ParamLayout;
use crate::stage::{Stage, StageKind};
use crate::{ModelConfig, ModelKind};

/// The stages of `c`'s architecture, their parameters created in `pb`.
pub(crate) fn stages(pb: &mut ParamLayout, c: &ModelConfig) -> Vec<Stage> {
    match c.kind {
        ModelKind::Sage => plain_stack(pb, c, sage::layer_weights),
        ModelKind::Gcn => plain_stack(pb, c, gcn::layer_weights),
        ModelKind::Mlp => plain_stack(pb, c, mlp::layer_weights),
        ModelKind::ResSage => ressage::stages(pb, c),
    }
}

/// The weights and bias of one layer of a plain stack, created for stage `s` (`d_in x d_out`):
/// `(w_self, w_neigh, bias)`, indices into the parameters.
type LayerWeights =
    fn(&mut ParamLayout, usize, usize, usize) -> (Option<usize>, Option<usize>, usize);

/// `c.layers` layers `in_dim -> hidden -> ... -> classes`: each drops out its input, applies
/// its weights and bias, and all but the last apply LayerNorm (if any) and ReLU after.
fn plain_stack(pb: &mut ParamLayout, c: &ModelConfig, weights: LayerWeights) -> Vec<Stage> {
    let mut stages = Vec::with_capacity(c.layers);
    for l in 0..c.layers {
        let s = stages.len();
        let d_in = if l == 0 { c.in_dim } else { c.hidden };
        let last = l + 1 == c.layers;
        let d_out = if last { c.classes } else { c.hidden };
        let (w_self, w_neigh, bias) = weights(pb, s, d_in, d_out);
        let (gamma, beta) = if last {
            (None, None)
        } else {
            pb.norm(s, d_out)
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
    stages
}
