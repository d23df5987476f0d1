//! The relation terms of a typed conv stage (R-GCN, hetero-SAGE): per relation, its
//! neighbour weight over the relation's block and, for models with a root term per
//! relation, its self weight and bias over the rows of its destination type. The stage's
//! own root weight, bias and post-ops run after, as for any conv stage (`crate::stage`).

use grandis_engine::norm::{relation_blocks, RelationBlocks};
use grandis_engine::{Backend, EngineError, Result};

use crate::stage::{RelationWeights, Stage, StageCache, StageCtx};
use crate::Model;

impl<B: Backend> Model<B> {
    /// The sum of every relation's terms (`n_dst x d_out`) from the stage's transformed input
    /// `z` (`n_src` rows); aggregate-first stages keep each relation's aggregate in `cache`.
    pub(crate) fn relation_terms(
        &self,
        b: &B,
        st: &Stage,
        ctx: &StageCtx<'_, B>,
        z: &B::Buf,
        cache: &mut StageCache<B>,
    ) -> Result<B::Buf> {
        check_relations(st, ctx)?;
        let (n_dst, n_src, d_in, d_out) = (ctx.n_dst, ctx.n_src, st.d_in, st.d_out);
        let mut y = b.alloc(n_dst * d_out)?;
        b.fill(&mut y, n_dst * d_out, 0.0)?;
        for (rw, graph) in st.relations.iter().zip(ctx.relations) {
            let w = &self.params[rw.w_neigh].value;
            if st.transforms_first() {
                let mut t = b.alloc(n_src * d_out)?;
                b.gemm(false, false, n_src, d_out, d_in, 1.0, z, w, 0.0, &mut t)?;
                let mut a = b.alloc(n_dst * d_out)?;
                b.aggregate(graph, &t, d_out, &mut a)?;
                b.axpy(1.0, &a, &mut y, n_dst * d_out)?;
            } else {
                let mut a = b.alloc(n_dst * d_in)?;
                b.aggregate(graph, z, d_in, &mut a)?;
                b.gemm(false, false, n_dst, d_out, d_in, 1.0, &a, w, 1.0, &mut y)?;
                cache.push_relation_agg(a);
            }
            if let Some(ws) = rw.w_self {
                let m = type_rows(b, rw, ctx, z, d_in)?;
                let ws = &self.params[ws].value;
                b.gemm(false, false, n_dst, d_out, d_in, 1.0, &m, ws, 1.0, &mut y)?;
            }
            if let Some(bias) = rw.bias {
                let ind = type_indicator(b, rw, ctx)?;
                let bias = &self.params[bias].value;
                b.gemm(false, false, n_dst, d_out, 1, 1.0, &ind, bias, 1.0, &mut y)?;
            }
        }
        Ok(y)
    }

    /// Backward of [`Self::relation_terms`] given `g`, the gradient of its output: adds the
    /// relations' weight gradients and returns the gradient of `z` when `need_gz`.
    #[allow(clippy::too_many_arguments)]
    pub(crate) fn relation_terms_backward(
        &mut self,
        b: &B,
        st: &Stage,
        ctx: &StageCtx<'_, B>,
        z: &B::Buf,
        g: &B::Buf,
        cache: &StageCache<B>,
        need_gz: bool,
    ) -> Result<Option<B::Buf>> {
        check_relations(st, ctx)?;
        let (n_dst, n_src, d_in, d_out) = (ctx.n_dst, ctx.n_src, st.d_in, st.d_out);
        let mut gz = if need_gz {
            let mut buf = b.alloc(n_src * d_in)?;
            b.fill(&mut buf, n_src * d_in, 0.0)?;
            Some(buf)
        } else {
            None
        };
        // Through a block (a relation's, or a type's rows): `gz += graphᵀ rows`.
        let add_through = |graph: &B::Graph, rows: &B::Buf, gz: &mut B::Buf| -> Result<()> {
            let mut t = b.alloc(n_src * d_in)?;
            b.aggregate_backward(graph, rows, d_in, &mut t)?;
            b.axpy(1.0, &t, gz, n_src * d_in)
        };
        for (r, (rw, graph)) in st.relations.iter().zip(ctx.relations).enumerate() {
            if st.transforms_first() {
                let mut gt = b.alloc(n_src * d_out)?;
                b.aggregate_backward(graph, g, d_out, &mut gt)?;
                self.accumulate_weight_grad(b, rw.w_neigh, z, &gt, n_src, d_in, d_out)?;
                if let Some(gz) = &mut gz {
                    self.input_grad(b, rw.w_neigh, &gt, n_src, d_in, d_out, 1.0, gz)?;
                }
            } else {
                let a = cache.relation_agg(r);
                self.accumulate_weight_grad(b, rw.w_neigh, a, g, n_dst, d_in, d_out)?;
                if let Some(gz) = &mut gz {
                    let mut ga = b.alloc(n_dst * d_in)?;
                    self.input_grad(b, rw.w_neigh, g, n_dst, d_in, d_out, 0.0, &mut ga)?;
                    add_through(graph, &ga, gz)?;
                }
            }
            if let Some(ws) = rw.w_self {
                let m = type_rows(b, rw, ctx, z, d_in)?;
                self.accumulate_weight_grad(b, ws, &m, g, n_dst, d_in, d_out)?;
                if let Some(gz) = &mut gz {
                    let mut gm = b.alloc(n_dst * d_in)?;
                    self.input_grad(b, ws, g, n_dst, d_in, d_out, 0.0, &mut gm)?;
                    add_through(&ctx.type_masks[rw.dst_type], &gm, gz)?;
                }
            }
            if let Some(bias) = rw.bias {
                let ind = type_indicator(b, rw, ctx)?;
                let grad = &mut self.params[bias].grad;
                b.gemm(true, false, 1, d_out, n_dst, 1.0, &ind, g, 1.0, grad)?;
            }
        }
        Ok(gz)
    }
}

/// That the block was split for this stage's relations and types.
fn check_relations<B: Backend>(st: &Stage, ctx: &StageCtx<'_, B>) -> Result<()> {
    let types = st
        .relations
        .iter()
        .map(|r| r.dst_type + 1)
        .max()
        .unwrap_or(0);
    if ctx.relations.len() != st.relations.len() || ctx.type_masks.len() < types {
        return Err(EngineError::Graph(format!(
            "a typed stage of {} relations got a block split into {} relations and {} types",
            st.relations.len(),
            ctx.relations.len(),
            ctx.type_masks.len()
        )));
    }
    Ok(())
}

/// The destination rows of `z` of `rw`'s destination type, the others zero (`n_dst x d`).
fn type_rows<B: Backend>(
    b: &B,
    rw: &RelationWeights,
    ctx: &StageCtx<'_, B>,
    z: &B::Buf,
    d: usize,
) -> Result<B::Buf> {
    let mut m = b.alloc(ctx.n_dst * d)?;
    b.aggregate(&ctx.type_masks[rw.dst_type], z, d, &mut m)?;
    Ok(m)
}

/// One column: 1 on the destination rows of `rw`'s destination type, 0 elsewhere.
fn type_indicator<B: Backend>(
    b: &B,
    rw: &RelationWeights,
    ctx: &StageCtx<'_, B>,
) -> Result<B::Buf> {
    let mut ones = b.alloc(ctx.n_src)?;
    b.fill(&mut ones, ctx.n_src, 1.0)?;
    type_rows(b, rw, ctx, &ones, 1)
}

/// A block split by relation for `config`'s model: `Some` for a typed model
/// ([`grandis_engine::norm::relation_blocks`] with the types of the block's source rows,
/// `src_ids` being their dataset ids), `None` for the others, which read the block whole.
pub fn split_block(
    config: &crate::ModelConfig,
    block: &grandis_engine::BlockGraph,
    types: Option<&grandis_store::Types>,
    src_ids: &[u32],
) -> Result<Option<RelationBlocks>> {
    if !config.kind.is_typed() {
        return Ok(None);
    }
    let types = types.ok_or_else(|| {
        EngineError::Graph(format!(
            "{} reads a typed dataset's relations, and the dataset has no types",
            config.kind
        ))
    })?;
    relation_blocks(block, types, &types.types_of(src_ids)).map(Some)
}

/// A block's relation graphs on a backend ([`StageCtx::relations`] and
/// [`StageCtx::type_masks`]); empty for untyped models.
pub struct RelationGraphs<B: Backend> {
    pub relations: Vec<B::Graph>,
    pub type_masks: Vec<B::Graph>,
}

impl<B: Backend> RelationGraphs<B> {
    pub fn none() -> Self {
        RelationGraphs {
            relations: Vec::new(),
            type_masks: Vec::new(),
        }
    }

    /// Uploads a split of [`split_block`] (nothing for `None`).
    pub fn upload(b: &B, split: Option<&RelationBlocks>) -> Result<Self> {
        let Some(split) = split else {
            return Ok(Self::none());
        };
        let up = |gs: &[grandis_engine::BlockGraph]| {
            gs.iter()
                .map(|g| b.upload_graph(g))
                .collect::<Result<Vec<_>>>()
        };
        Ok(RelationGraphs {
            relations: up(&split.relations)?,
            type_masks: up(&split.type_masks)?,
        })
    }
}
