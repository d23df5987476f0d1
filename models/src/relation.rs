//! The relation terms of a typed conv stage (R-GCN, hetero-SAGE, R-GAT): per relation, its
//! neighbour weight over the relation's block (R-GAT: its attention over the block, with the
//! weight mapping both ends' rows) and, for models with a root term per relation, its self
//! weight and bias over the rows of its destination type. Each weight
//! multiplies only the rows of the type it applies to (gathered, then scattered back), as
//! PyG's per-type layers do, not the whole block's. The stage's own root weight, bias and
//! post-ops run after, as for any conv stage (`crate::stage`).

use grandis_engine::norm::{relation_blocks, RelationBlocks};
use grandis_engine::{Backend, EngineError, PreparedGraph, Result};

use crate::param::two_mut;
use crate::stage::{AttentionLayer, RelationWeights, Stage, StageCache, StageCtx};
use crate::Model;

/// A block split by relation for a model of `kind`: `Some` for a typed model
/// ([`grandis_engine::norm::relation_blocks`] with the types of the block's source rows,
/// `src_ids` being their dataset ids), `None` for the others, which read the block whole.
/// Every runner (the single trainer, layer-wise passes, the distributed ranks' inputs)
/// splits its blocks here.
pub fn split_block(
    kind: crate::ModelKind,
    block: &grandis_engine::BlockGraph,
    types: Option<&grandis_store::Types>,
    src_ids: &[u32],
) -> anyhow::Result<Option<RelationBlocks>> {
    if !kind.is_typed() {
        return Ok(None);
    }
    let Some(types) = types else {
        anyhow::bail!(
            "model {kind} reads a typed dataset's relations, and this dataset has no types \
             (see `grandis data synth --hetero`)"
        );
    };
    Ok(Some(relation_blocks(
        block,
        types,
        &types.types_of(src_ids),
    )?))
}

/// A [`RelationBlocks`] with its relation blocks checked and transposed on the host, as a
/// step's producer prepares it, ready for [`RelationGraphs::upload_prepared`].
pub struct PreparedRelations {
    relations: Vec<PreparedGraph>,
    src_rows: Vec<Vec<u32>>,
    dst_rows: Vec<Vec<u32>>,
}

impl PreparedRelations {
    pub fn new(split: RelationBlocks) -> Result<Self> {
        Ok(PreparedRelations {
            relations: split
                .relations
                .into_iter()
                .map(PreparedGraph::new)
                .collect::<Result<_>>()?,
            src_rows: split.src_rows,
            dst_rows: split.dst_rows,
        })
    }
}

/// A block's relation graphs and each type's rows on a backend ([`StageCtx::typed`]).
pub struct RelationGraphs<B: Backend> {
    pub(crate) relations: Vec<B::Graph>,
    /// Per type: its rows among the block's sources, and their count.
    pub(crate) src_rows: Vec<(B::Index, usize)>,
    /// Per type: its rows among the destinations, and their count.
    pub(crate) dst_rows: Vec<(B::Index, usize)>,
}

impl<B: Backend> RelationGraphs<B> {
    fn rows(b: &B, rows: &[Vec<u32>]) -> Result<Vec<(B::Index, usize)>> {
        rows.iter()
            .map(|r| Ok((b.upload_index(r)?, r.len())))
            .collect()
    }

    /// Uploads a split of [`split_block`] (None for `None`).
    pub fn upload(b: &B, split: Option<&RelationBlocks>) -> Result<Option<Self>> {
        let Some(split) = split else {
            return Ok(None);
        };
        Ok(Some(RelationGraphs {
            relations: split
                .relations
                .iter()
                .map(|g| b.upload_graph(g))
                .collect::<Result<_>>()?,
            src_rows: Self::rows(b, &split.src_rows)?,
            dst_rows: Self::rows(b, &split.dst_rows)?,
        }))
    }

    /// Uploads a prepared split (a copy of what the host built).
    pub fn upload_prepared(b: &B, split: &PreparedRelations) -> Result<Self> {
        Ok(RelationGraphs {
            relations: split
                .relations
                .iter()
                .map(|g| b.upload_prepared(g))
                .collect::<Result<_>>()?,
            src_rows: Self::rows(b, &split.src_rows)?,
            dst_rows: Self::rows(b, &split.dst_rows)?,
        })
    }
}

/// `rows` rows of `x` (`cols` columns) picked by `idx`.
fn gather<B: Backend>(
    b: &B,
    x: &B::Buf,
    cols: usize,
    (idx, rows): &(B::Index, usize),
) -> Result<B::Buf> {
    let mut out = b.alloc(rows * cols)?;
    b.gather_rows(x, cols, idx, &mut out)?;
    Ok(out)
}

/// A zero `rows x cols` matrix with `x`'s rows added at `idx`. (Here and below a new buffer is
/// used as zeros: `alloc` zero-fills on every backend, so no `fill` pass follows it.)
fn scatter<B: Backend>(
    b: &B,
    x: &B::Buf,
    cols: usize,
    idx: &(B::Index, usize),
    rows: usize,
) -> Result<B::Buf> {
    let mut out = b.alloc(rows * cols)?;
    b.scatter_add_rows(x, cols, &idx.0, &mut out)?;
    Ok(out)
}

impl<B: Backend> Model<B> {
    /// The sum of every relation's terms (`n_dst x d_out`) from the input `z` (`n_src` rows)
    /// of stage `s`; aggregate-first stages keep each relation's gathered aggregate in
    /// `cache`, attention relations their log-sum-exp.
    pub(crate) fn relation_terms(
        &self,
        b: &B,
        st: &Stage,
        s: usize,
        ctx: &StageCtx<'_, B>,
        z: &B::Buf,
        cache: &mut StageCache<B>,
    ) -> Result<B::Buf> {
        let tg = typed_graphs(st, ctx)?;
        let (n_dst, n_src, d_in, d_out) = (ctx.n_dst, ctx.n_src, st.d_in, st.d_out);
        let mut y = b.alloc(n_dst * d_out)?;
        let derived = self.derived_weights(b, st)?;
        for (r, (rw, graph)) in st.relations.iter().zip(&tg.relations).enumerate() {
            let (src, dst) = (&tg.src_rows[rw.src_type], &tg.dst_rows[rw.dst_type]);
            if src.1 == 0 || dst.1 == 0 {
                cache.push_relation_agg(None);
                continue;
            }
            let w = self.neighbour_weight(rw, r, &derived);
            if let Some(at) = rw.attention {
                let t = relation_rows(b, z, d_in, &at, w, &attended_rows(rw, src, dst), n_src)?;
                let (_, scores) = self.attention_scores(b, s, &at, &t, n_src)?;
                let args = self.attention_args(&at, s, ctx, false);
                let mut out = b.alloc(n_dst * d_out)?;
                let mut lse = b.alloc(n_dst * at.heads)?;
                b.attention_aggregate(graph, &t, &scores, &args, &mut out, &mut lse)?;
                b.axpy(1.0, &out, &mut y, n_dst * d_out)?;
                cache.push_relation_agg(Some(lse));
            } else if st.transforms_first() {
                // Transform the source type's rows, aggregate them into the destinations.
                let zs = gather(b, z, d_in, src)?;
                let mut ts = b.alloc(src.1 * d_out)?;
                b.gemm(false, false, src.1, d_out, d_in, 1.0, &zs, w, 0.0, &mut ts)?;
                let t = scatter(b, &ts, d_out, src, n_src)?;
                let mut a = b.alloc(n_dst * d_out)?;
                b.aggregate(graph, &t, d_out, &mut a)?;
                b.axpy(1.0, &a, &mut y, n_dst * d_out)?;
                cache.push_relation_agg(None);
            } else {
                // Aggregate, then transform the destination type's rows.
                let mut a = b.alloc(n_dst * d_in)?;
                b.aggregate(graph, z, d_in, &mut a)?;
                let at = gather(b, &a, d_in, dst)?;
                let mut o = b.alloc(dst.1 * d_out)?;
                b.gemm(false, false, dst.1, d_out, d_in, 1.0, &at, w, 0.0, &mut o)?;
                b.scatter_add_rows(&o, d_out, &dst.0, &mut y)?;
                cache.push_relation_agg(Some(at));
            }
        }
        for (t, rels) in root_terms(st) {
            let dst = &tg.dst_rows[t];
            if dst.1 == 0 {
                continue;
            }
            let zt = gather(b, z, d_in, dst)?;
            let mut o = b.alloc(dst.1 * d_out)?;
            for (i, rw) in rels.iter().enumerate() {
                if let Some(ws) = rw.w_self {
                    let ws = &self.params[ws].value;
                    let beta = if i == 0 { 0.0 } else { 1.0 };
                    b.gemm(false, false, dst.1, d_out, d_in, 1.0, &zt, ws, beta, &mut o)?;
                }
                if let Some(bias) = rw.bias {
                    b.add_bias(&mut o, &self.params[bias].value, dst.1, d_out)?;
                }
            }
            b.scatter_add_rows(&o, d_out, &dst.0, &mut y)?;
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
        s: usize,
        ctx: &StageCtx<'_, B>,
        z: &B::Buf,
        g: &B::Buf,
        cache: &StageCache<B>,
        need_gz: bool,
    ) -> Result<Option<B::Buf>> {
        let tg = typed_graphs(st, ctx)?;
        let (n_dst, n_src, d_in, d_out) = (ctx.n_dst, ctx.n_src, st.d_in, st.d_out);
        let mut gz = if need_gz {
            Some(b.alloc(n_src * d_in)?)
        } else {
            None
        };
        let derived = self.derived_weights(b, st)?;
        // With bases: each relation's weight gradient, folded into the bases and
        // coefficients at the end.
        let mut derived_grads = match &derived {
            Some(ws) => Some(
                ws.iter()
                    .map(|_| b.alloc(d_in * d_out))
                    .collect::<Result<Vec<_>>>()?,
            ),
            None => None,
        };
        for (r, (rw, graph)) in st.relations.iter().zip(&tg.relations).enumerate() {
            let (src, dst) = (&tg.src_rows[rw.src_type], &tg.dst_rows[rw.dst_type]);
            if src.1 == 0 || dst.1 == 0 {
                continue;
            }
            if let Some(at) = rw.attention {
                let lse = cache
                    .relation_agg(r)
                    .expect("attention relations keep their log-sum-exp");
                let rows = attended_rows(rw, src, dst);
                let p = rw.w_neigh.expect("an R-GAT relation has its own weight");
                let attended = Attended {
                    at: &at,
                    weight: p,
                    graph,
                    rows: &rows,
                };
                self.relation_attention_backward(
                    b,
                    s,
                    ctx,
                    &attended,
                    z,
                    d_in,
                    g,
                    lse,
                    gz.as_mut(),
                )?;
                continue;
            }
            // `grad(W_r) += xᵀ g` into the relation's own parameter or its derived gradient.
            let mut weight_grad = |x: &B::Buf, g: &B::Buf, rows: usize| -> Result<()> {
                let out = match (rw.w_neigh, derived_grads.as_mut()) {
                    (Some(p), _) => &mut self.params[p].grad,
                    (None, Some(grads)) => &mut grads[r],
                    (None, None) => unreachable!("a relation without a weight has bases"),
                };
                b.gemm(true, false, d_in, d_out, rows, 1.0, x, g, 1.0, out)
            };
            if st.transforms_first() {
                let mut gt = b.alloc(n_src * d_out)?;
                b.aggregate_backward(graph, g, d_out, &mut gt)?;
                let gts = gather(b, &gt, d_out, src)?;
                let zs = gather(b, z, d_in, src)?;
                weight_grad(&zs, &gts, src.1)?;
                if let Some(gz) = &mut gz {
                    let w = self.neighbour_weight(rw, r, &derived);
                    let mut gzs = b.alloc(src.1 * d_in)?;
                    b.gemm(false, true, src.1, d_in, d_out, 1.0, &gts, w, 0.0, &mut gzs)?;
                    b.scatter_add_rows(&gzs, d_in, &src.0, gz)?;
                }
            } else {
                let at = cache
                    .relation_agg(r)
                    .expect("aggregate-first relations keep their aggregate");
                let gt = gather(b, g, d_out, dst)?;
                weight_grad(at, &gt, dst.1)?;
                if let Some(gz) = &mut gz {
                    let w = self.neighbour_weight(rw, r, &derived);
                    let mut gat = b.alloc(dst.1 * d_in)?;
                    b.gemm(false, true, dst.1, d_in, d_out, 1.0, &gt, w, 0.0, &mut gat)?;
                    let ga = scatter(b, &gat, d_in, dst, n_dst)?;
                    let mut through = b.alloc(n_src * d_in)?;
                    b.aggregate_backward(graph, &ga, d_in, &mut through)?;
                    b.axpy(1.0, &through, gz, n_src * d_in)?;
                }
            }
        }
        for (t, rels) in root_terms(st) {
            let dst = &tg.dst_rows[t];
            if dst.1 == 0 {
                continue;
            }
            let zt = gather(b, z, d_in, dst)?;
            let gt = gather(b, g, d_out, dst)?;
            let mut gzt = match gz {
                Some(_) => Some(b.alloc(dst.1 * d_in)?),
                None => None,
            };
            for (i, rw) in rels.iter().enumerate() {
                if let Some(ws) = rw.w_self {
                    self.accumulate_weight_grad(b, ws, &zt, &gt, dst.1, d_in, d_out)?;
                    if let Some(gzt) = &mut gzt {
                        let beta = if i == 0 { 0.0 } else { 1.0 };
                        self.input_grad(b, ws, &gt, dst.1, d_in, d_out, beta, gzt)?;
                    }
                }
                if let Some(bias) = rw.bias {
                    b.col_sum(&gt, dst.1, d_out, 1.0, &mut self.params[bias].grad)?;
                }
            }
            if let (Some(gz), Some(gzt)) = (&mut gz, &gzt) {
                b.scatter_add_rows(gzt, d_in, &dst.0, gz)?;
            }
        }
        if let (Some(bases), Some(grads)) = (st.bases, derived_grads) {
            // W = comp basis (R x k = R x B times B x k, k = d_in d_out): grad(comp) +=
            // grad(W) basisᵀ and grad(basis) += compᵀ grad(W).
            let (k, relations) = (d_in * d_out, grads.len());
            let mut gw = b.alloc(relations * k)?;
            for (r, g) in grads.iter().enumerate() {
                b.copy_range(g, 0, &mut gw, r * k, k)?;
            }
            let (comp, basis) = two_mut(&mut self.params, bases.comp, bases.basis);
            let n = bases.count;
            b.gemm(
                false,
                true,
                relations,
                n,
                k,
                1.0,
                &gw,
                &basis.value,
                1.0,
                &mut comp.grad,
            )?;
            b.gemm(
                true,
                false,
                n,
                k,
                relations,
                1.0,
                &comp.value,
                &gw,
                1.0,
                &mut basis.grad,
            )?;
        }
        Ok(gz)
    }

    /// Backward of one R-GAT relation's attention term given `g`, the gradient of the stage's
    /// output: adds its weight's and attention vectors' gradients and, with `gz`, the
    /// gradient of the input rows it reads.
    #[allow(clippy::too_many_arguments)]
    fn relation_attention_backward(
        &mut self,
        b: &B,
        s: usize,
        ctx: &StageCtx<'_, B>,
        rel: &Attended<'_, B>,
        z: &B::Buf,
        d_in: usize,
        g: &B::Buf,
        lse: &B::Buf,
        mut gz: Option<&mut B::Buf>,
    ) -> Result<()> {
        let (n_dst, n_src) = (ctx.n_dst, ctx.n_src);
        let at = rel.at;
        let (c, h2) = (at.heads * at.head_dim, 2 * at.heads);
        let w = &self.params[rel.weight].value;
        let t = relation_rows(b, z, d_in, at, w, rel.rows, n_src)?;
        let (a, scores) = self.attention_scores(b, s, at, &t, n_src)?;
        let args = self.attention_args(at, s, ctx, false);
        let mut gt = b.alloc(n_src * c)?;
        let mut gscores = b.alloc(n_src * h2)?;
        let mut scratch = b.alloc(n_dst * at.heads)?;
        b.attention_aggregate_backward(
            rel.graph,
            &t,
            &scores,
            lse,
            &args,
            g,
            &mut gt,
            &mut gscores,
            &mut scratch,
        )?;
        self.attention_vector_grads(b, s, at, &t, &gscores, n_src)?;
        // Through the scores into t, then through t = z W on the rows it maps.
        b.gemm(false, true, n_src, c, h2, 1.0, &gscores, &a, 1.0, &mut gt)?;
        for rows in rel.rows {
            let zs = gather(b, z, d_in, rows)?;
            let gts = gather(b, &gt, c, rows)?;
            self.accumulate_weight_grad(b, rel.weight, &zs, &gts, rows.1, d_in, c)?;
            if let Some(gz) = gz.as_deref_mut() {
                let mut gzs = b.alloc(rows.1 * d_in)?;
                self.input_grad(b, rel.weight, &gts, rows.1, d_in, c, 0.0, &mut gzs)?;
                b.scatter_add_rows(&gzs, d_in, &rows.0, gz)?;
            }
        }
        Ok(())
    }

    /// With basis decomposition, every relation's neighbour weight made from the bases
    /// (`W = comp basis`, one `d_in x d_out` buffer per relation); None without.
    fn derived_weights(&self, b: &B, st: &Stage) -> Result<Option<Vec<B::Buf>>> {
        let Some(bases) = st.bases else {
            return Ok(None);
        };
        let (k, relations) = (st.d_in * st.d_out, st.relations.len());
        let (comp, basis) = (
            &self.params[bases.comp].value,
            &self.params[bases.basis].value,
        );
        let mut all = b.alloc(relations * k)?;
        b.gemm(
            false,
            false,
            relations,
            k,
            bases.count,
            1.0,
            comp,
            basis,
            0.0,
            &mut all,
        )?;
        (0..relations)
            .map(|r| {
                let mut w = b.alloc(k)?;
                b.copy_range(&all, r * k, &mut w, 0, k)?;
                Ok(w)
            })
            .collect::<Result<Vec<_>>>()
            .map(Some)
    }

    /// Relation `r`'s neighbour weight: its own, or the one its bases make.
    fn neighbour_weight<'a>(
        &'a self,
        rw: &RelationWeights,
        r: usize,
        derived: &'a Option<Vec<B::Buf>>,
    ) -> &'a B::Buf {
        match (rw.w_neigh, derived) {
            (Some(p), _) => &self.params[p].value,
            (None, Some(ws)) => &ws[r],
            (None, None) => unreachable!("a relation without a weight has bases"),
        }
    }
}

/// One R-GAT relation's attention term: its shape and vectors, its weight (a parameter
/// index), its block and the rows its weight maps ([`attended_rows`]).
struct Attended<'a, B: Backend> {
    at: &'a AttentionLayer,
    weight: usize,
    graph: &'a B::Graph,
    rows: &'a [&'a (B::Index, usize)],
}

/// The rows an R-GAT relation maps with its weight: its source type's, and its destination
/// type's when they differ (for their destination scores; a relation into its own type finds
/// its destinations, the block's first sources, among its sources).
fn attended_rows<'a, I>(
    rw: &RelationWeights,
    src: &'a (I, usize),
    dst: &'a (I, usize),
) -> Vec<&'a (I, usize)> {
    if rw.src_type == rw.dst_type {
        vec![src]
    } else {
        vec![src, dst]
    }
}

/// R-GAT's `t = z W` on `rows` of the block's `n_src` sources (`heads * head_dim` columns,
/// zero on the rows of other types).
fn relation_rows<B: Backend>(
    b: &B,
    z: &B::Buf,
    d_in: usize,
    at: &AttentionLayer,
    w: &B::Buf,
    rows: &[&(B::Index, usize)],
    n_src: usize,
) -> Result<B::Buf> {
    let c = at.heads * at.head_dim;
    let mut t = b.alloc(n_src * c)?;
    for idx in rows {
        let zs = gather(b, z, d_in, idx)?;
        let mut ts = b.alloc(idx.1 * c)?;
        b.gemm(false, false, idx.1, c, d_in, 1.0, &zs, w, 0.0, &mut ts)?;
        b.scatter_add_rows(&ts, c, &idx.0, &mut t)?;
    }
    Ok(t)
}

/// Per destination type, the relations into it with a root term (hetero-SAGE's self weight
/// and bias), each type once, in type order.
fn root_terms(st: &Stage) -> Vec<(usize, Vec<&RelationWeights>)> {
    let mut by_type: Vec<(usize, Vec<&RelationWeights>)> = Vec::new();
    for rw in st
        .relations
        .iter()
        .filter(|rw| rw.w_self.is_some() || rw.bias.is_some())
    {
        match by_type.iter_mut().find(|(t, _)| *t == rw.dst_type) {
            Some((_, rels)) => rels.push(rw),
            None => by_type.push((rw.dst_type, vec![rw])),
        }
    }
    by_type.sort_by_key(|(t, _)| *t);
    by_type
}

/// The stage's block split, checked against its relations and types.
fn typed_graphs<'a, B: Backend>(
    st: &Stage,
    ctx: &StageCtx<'a, B>,
) -> Result<&'a RelationGraphs<B>> {
    let types = st
        .relations
        .iter()
        .map(|r| r.src_type.max(r.dst_type) + 1)
        .max()
        .unwrap_or(0);
    match ctx.typed {
        Some(tg)
            if tg.relations.len() == st.relations.len()
                && tg.src_rows.len() >= types
                && tg.dst_rows.len() >= types =>
        {
            Ok(tg)
        }
        other => Err(EngineError::Graph(format!(
            "a typed stage of {} relations got a block split into {} relations",
            st.relations.len(),
            other.map_or(0, |tg| tg.relations.len())
        ))),
    }
}
