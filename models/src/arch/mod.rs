//! One file per architecture. Each lays out the stages of its model and declares their
//! parameters in a [`ParamLayout`] in a fixed order, so a seed fixes every initial weight and
//! the shapes are known without a backend. Sage, GCN, GAT and the MLP are plain stacks that
//! differ only in the weights of a layer; ResSAGE+ has an encoder, res+ blocks and a head.

mod gat;
mod gcn;
mod heterosage;
mod mlp;
mod ressage;
mod rgat;
mod rgcn;
mod sage;

use crate::param::ParamLayout;
use crate::stage::{AttentionLayer, RelationBases, RelationWeights, Stage, StageKind};
use crate::{ModelConfig, ModelKind, StageLayout};

/// The stages of `c`'s architecture, their parameters created in `pb`.
pub(crate) fn stages(pb: &mut ParamLayout, c: &ModelConfig) -> Vec<Stage> {
    match c.kind {
        ModelKind::Sage => plain_stack(pb, c, sage::layer_weights),
        ModelKind::Gcn => plain_stack(pb, c, gcn::layer_weights),
        ModelKind::Mlp => plain_stack(pb, c, mlp::layer_weights),
        ModelKind::Gat => plain_stack(pb, c, gat::layer_weights),
        ModelKind::ResSage => ressage::stages(pb, c),
        ModelKind::Rgcn => plain_stack(pb, c, rgcn::layer_weights),
        ModelKind::HeteroSage => plain_stack(pb, c, heterosage::layer_weights),
        ModelKind::Rgat => plain_stack(pb, c, rgat::layer_weights),
    }
}

/// The layout of `c`'s stages as [`StageLayout`] describes it (checked against the stages
/// built by [`stages`] in the tests of `crate::config`).
pub(crate) fn stage_layout(c: &ModelConfig) -> StageLayout {
    let plain = StageLayout {
        first_conv: 0,
        has_head: false,
        reads_graph: true,
        conv_in: c.in_dim,
        conv_out: c.classes,
        recomputes_conv_inputs: false,
        attention_output_heads: None,
    };
    match c.kind {
        ModelKind::Sage | ModelKind::Gcn | ModelKind::Rgcn | ModelKind::HeteroSage => plain,
        ModelKind::Mlp => StageLayout {
            reads_graph: false,
            ..plain
        },
        ModelKind::Gat | ModelKind::Rgat => StageLayout {
            attention_output_heads: Some(c.output_heads),
            ..plain
        },
        // Encoder, res+ convolutions over hidden-width rows, head.
        ModelKind::ResSage => StageLayout {
            first_conv: 1,
            has_head: true,
            reads_graph: true,
            conv_in: c.hidden,
            conv_out: c.hidden,
            recomputes_conv_inputs: true,
            attention_output_heads: None,
        },
    }
}

/// One layer of a plain stack: stage `s`, `d_in -> d_out`, and whether it is the last.
pub(super) struct Layer {
    pub s: usize,
    pub d_in: usize,
    pub d_out: usize,
    pub last: bool,
}

/// The parameters of one layer of a plain stack (indices into the model's parameters).
pub(super) struct LayerParams {
    /// Applied to the vertex's own row.
    pub w_self: Option<usize>,
    /// Applied to the rows it aggregates (GAT: the shared map of every row).
    pub w_neigh: Option<usize>,
    /// None when each relation has its own (hetero-SAGE).
    pub bias: Option<usize>,
    pub attention: Option<AttentionLayer>,
    /// Typed models: one per relation of the dataset, in order.
    pub relations: Vec<RelationWeights>,
    /// RGCN with basis decomposition.
    pub bases: Option<RelationBases>,
}

impl LayerParams {
    /// A typed layer whose every weight is its relations' (hetero-SAGE, R-GAT).
    fn of_relations(relations: Vec<RelationWeights>) -> LayerParams {
        LayerParams {
            w_self: None,
            w_neigh: None,
            bias: None,
            attention: None,
            relations,
            bases: None,
        }
    }
}

/// Creates the parameters of one layer of a plain stack.
type LayerWeights = fn(&mut ParamLayout, &ModelConfig, &Layer) -> LayerParams;

/// `c.layers` layers `in_dim -> hidden -> ... -> classes`: each drops out its input, applies
/// its weights and bias, and all but the last apply LayerNorm (if any) and ReLU after.
fn plain_stack(pb: &mut ParamLayout, c: &ModelConfig, weights: LayerWeights) -> Vec<Stage> {
    let mut stages = Vec::with_capacity(c.layers);
    for l in 0..c.layers {
        let s = stages.len();
        let d_in = if l == 0 { c.in_dim } else { c.hidden };
        let last = l + 1 == c.layers;
        let d_out = if last { c.classes } else { c.hidden };
        let layer = Layer {
            s,
            d_in,
            d_out,
            last,
        };
        let p = weights(pb, c, &layer);
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
            w_self: p.w_self,
            w_neigh: p.w_neigh,
            bias: p.bias,
            gamma,
            beta,
            attention: p.attention,
            relations: p.relations,
            bases: p.bases,
        });
    }
    stages
}
