//! ResSAGE+: DeeperGCN's `res+` blocks over SAGE convolutions. A linear encoder maps the
//! features to `hidden`; conv `l` computes `h + SAGE(dropout(relu(norm(h))))` for `l > 0` (the
//! first reads the encoder output directly); the head is `norm -> relu -> dropout -> linear`.

use crate::param::ParamLayout;
use crate::stage::{Stage, StageKind};
use crate::ModelConfig;

/// Encoder, `c.layers` res+ convolutions, head.
pub(super) fn stages(pb: &mut ParamLayout, c: &ModelConfig) -> Vec<Stage> {
    let h = c.hidden;
    let mut stages = Vec::with_capacity(c.layers + 2);
    let w = pb.linear(0, "weight", c.in_dim, h);
    let bias = pb.bias(0, h, c.in_dim);
    stages.push(Stage {
        w_self: Some(w),
        bias: Some(bias),
        ..Stage::new(StageKind::Encoder, c.in_dim, h)
    });
    for l in 0..c.layers {
        let s = stages.len();
        let w_self = Some(pb.linear(s, "w_self", h, h));
        let w_neigh = Some(pb.linear(s, "w_neigh", h, h));
        let bias = pb.bias(s, h, h);
        // The first convolution reads the encoder output directly (DeeperGCN).
        let (gamma, beta) = if l == 0 { (None, None) } else { pb.norm(s, h) };
        let kind = StageKind::Conv {
            pre: l > 0,
            post: false,
            residual: l > 0,
        };
        stages.push(Stage {
            w_self,
            w_neigh,
            bias: Some(bias),
            gamma,
            beta,
            ..Stage::new(kind, h, h)
        });
    }
    let s = stages.len();
    let (gamma, beta) = pb.norm(s, h);
    let w = pb.linear(s, "weight", h, c.classes);
    let bias = pb.bias(s, c.classes, h);
    stages.push(Stage {
        w_self: Some(w),
        bias: Some(bias),
        gamma,
        beta,
        ..Stage::new(StageKind::Head, h, c.classes)
    });
    stages
}
