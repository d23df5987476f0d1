//! R-GAT: GAT per relation, summed: PyG's `to_hetero` of a `GATConv(add_self_loops=False)`
//! stack (equivalently `HeteroConv({r: GATConv(..., add_self_loops=False)}, aggr="sum")`,
//! the model of the MLPerf GNN benchmark) on a typed dataset. Relation `r` from type `s`
//! into type `t` has its own `GATConv`: one weight maps the rows of both ends, `t = h W_r`;
//! each edge `u -> v` of `r` is scored per head with
//! `LeakyReLU_0.2(t_u · att_src,r + t_v · att_dst,r)`, normalised over `v`'s `r`-neighbours
//! (no self-loop: a vertex without them gets only the bias `b_r`) and dropped out at the
//! model's dropout in training; a vertex's output is the sum over the relations into its type
//! (a type no relation enters outputs zeros, as PyG drops it). Heads as in GAT: hidden layers
//! concatenate `heads` heads of `hidden / heads` columns, the last averages `output_heads`
//! heads of `classes`. Initialisation is PyG's: Glorot weights and attention vectors, zero
//! bias.

use super::{Layer, LayerParams};
use crate::param::ParamLayout;
use crate::stage::{AttentionLayer, RelationWeights};
use crate::ModelConfig;

/// Each relation's weight, attention vectors and bias, in the relations' order.
pub(super) fn layer_weights(pb: &mut ParamLayout, c: &ModelConfig, l: &Layer) -> LayerParams {
    let (heads, head_dim, concat) = super::gat::heads_of(c, l);
    let relations = c
        .relations
        .iter()
        .map(|r| {
            let name = |what: &str| format!("{}.{what}", r.key);
            RelationWeights {
                w_neigh: Some(pb.glorot(l.s, &name("weight"), l.d_in, heads * head_dim)),
                w_self: None,
                attention: Some(AttentionLayer {
                    heads,
                    head_dim,
                    concat,
                    att_src: pb.glorot(l.s, &name("att_src"), heads, head_dim),
                    att_dst: pb.glorot(l.s, &name("att_dst"), heads, head_dim),
                }),
                bias: Some(pb.named_zero_bias(l.s, &name("bias"), l.d_out)),
                src_type: r.src_type,
                dst_type: r.dst_type,
            }
        })
        .collect();
    LayerParams::of_relations(relations)
}
