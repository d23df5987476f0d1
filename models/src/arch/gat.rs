//! GAT (Veličković et al.) with PyG `GATConv` semantics: a layer maps every row with one
//! weight, `t = h W`; scores each edge `u -> v`, and one self-loop per vertex, per head with
//! `LeakyReLU_0.2(t_u · att_src + t_v · att_dst)`; normalises the scores with a softmax over
//! `v`'s sources; drops coefficients out at the model's dropout in training; and sums the
//! sources' `t` rows weighted by them. Hidden layers concatenate `heads` heads of
//! `hidden / heads` columns; the last averages `output_heads` heads of `classes` columns.
//! There is no root weight: a vertex's own row enters through its self-loop. Initialisation
//! is PyG's: Glorot weight and attention vectors, zero bias.

use super::{Layer, LayerParams};
use crate::param::ParamLayout;
use crate::stage::AttentionLayer;
use crate::ModelConfig;

/// A GAT layer's heads, columns per head and whether they are concatenated: hidden layers
/// concatenate `heads` heads splitting their width, the last averages `output_heads`.
pub(super) fn heads_of(c: &ModelConfig, l: &Layer) -> (usize, usize, bool) {
    if l.last {
        (c.output_heads, l.d_out, false)
    } else {
        (c.heads, l.d_out / c.heads, true)
    }
}

pub(super) fn layer_weights(pb: &mut ParamLayout, c: &ModelConfig, l: &Layer) -> LayerParams {
    let (heads, head_dim, concat) = heads_of(c, l);
    let weight = pb.glorot(l.s, "weight", l.d_in, heads * head_dim);
    let att_src = pb.glorot(l.s, "att_src", heads, head_dim);
    let att_dst = pb.glorot(l.s, "att_dst", heads, head_dim);
    LayerParams {
        w_self: None,
        w_neigh: Some(weight),
        bias: Some(pb.zero_bias(l.s, l.d_out)),
        attention: Some(AttentionLayer {
            heads,
            head_dim,
            concat,
            att_src,
            att_dst,
        }),
        relations: Vec::new(),
        bases: None,
    }
}
