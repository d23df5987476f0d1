//! Stages: what a model is a sequence of, and their forward and backward passes (see the crate
//! doc). A conv stage reads `n_src` rows and writes `n_dst`; a row-local stage (the ResSAGE+
//! encoder and head) maps rows to rows. Everything before a convolution is recomputed in
//! backward from the input rather than kept.

use grandis_engine::{Attention, AttentionDropout, Backend, DropoutKey, Result};

use crate::param::two_mut;
use crate::Model;

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum StageKind {
    /// Linear `in -> hidden` (ResSAGE+ only), row-local.
    Encoder,
    /// Graph convolution (or a linear layer for `Mlp`). `pre`: norm/relu before dropout
    /// (res+ blocks); `post`: norm/relu after (plain models, all but the last); `residual`.
    Conv {
        pre: bool,
        post: bool,
        residual: bool,
    },
    /// `norm -> relu -> dropout -> linear` (ResSAGE+ only), row-local.
    Head,
}

#[derive(Debug, Clone)]
pub(crate) struct Stage {
    pub kind: StageKind,
    pub d_in: usize,
    pub d_out: usize,
    /// Indices into `Model::params`.
    pub w_self: Option<usize>,
    pub w_neigh: Option<usize>,
    /// None when each relation has its own (hetero-SAGE).
    pub bias: Option<usize>,
    pub gamma: Option<usize>,
    pub beta: Option<usize>,
    /// GAT's attention (its shared weight is `w_neigh`).
    pub attention: Option<AttentionLayer>,
    /// Typed models: per relation of the dataset, its weights (empty otherwise).
    pub relations: Vec<RelationWeights>,
    /// RGCN with basis decomposition: what the relations' neighbour weights are made of.
    pub bases: Option<RelationBases>,
}

/// RGCN's basis decomposition (Schlichtkrull et al.; PyG's `num_bases`): relation `r`'s
/// neighbour weight is `sum_b comp[r, b] basis[b]`.
#[derive(Debug, Clone, Copy)]
pub(crate) struct RelationBases {
    /// `bases x d_in x d_out`.
    pub basis: usize,
    /// `relations x bases`.
    pub comp: usize,
    pub count: usize,
}

/// The parameters of one relation in a typed conv stage ([`StageCtx::typed`]): its
/// neighbour weight over the relation's block and, for models with a root term per
/// relation, its self weight and bias over the rows of its destination type.
#[derive(Debug, Clone)]
pub(crate) struct RelationWeights {
    /// Its own neighbour weight, or None when the stage's [`RelationBases`] make it.
    pub w_neigh: Option<usize>,
    pub w_self: Option<usize>,
    pub bias: Option<usize>,
    /// R-GAT: the relation's attention over its block (its map is `w_neigh`).
    pub attention: Option<AttentionLayer>,
    pub src_type: usize,
    pub dst_type: usize,
}

/// The attention of a GAT layer: `heads` heads of `head_dim` columns, concatenated or
/// averaged, and its two attention vectors (`heads x head_dim` parameters each).
#[derive(Debug, Clone, Copy)]
pub(crate) struct AttentionLayer {
    pub heads: usize,
    pub head_dim: usize,
    pub concat: bool,
    pub att_src: usize,
    pub att_dst: usize,
}

impl AttentionLayer {
    /// Where the attention vectors go in the `(heads * head_dim) x 2 heads` block-diagonal
    /// matrix `A` for which `t A` holds every row's source scores (columns `0..heads`) and
    /// destination scores (`heads..2 heads`): element `k = h * head_dim + f` of `att_src`
    /// at `(k, h)`, of `att_dst` at `(k, heads + h)`, as flat offsets.
    pub fn positions(&self) -> [Vec<u32>; 2] {
        let (h, f) = (self.heads, self.head_dim);
        let at = |col: usize| -> Vec<u32> {
            (0..h * f)
                .map(|k| (k * 2 * h + col + k / f) as u32)
                .collect()
        };
        [at(0), at(h)]
    }
}

impl Stage {
    /// A stage of `kind` from `d_in` to `d_out` columns with no parameters yet: builders set
    /// the ones it has.
    pub(crate) fn new(kind: StageKind, d_in: usize, d_out: usize) -> Stage {
        Stage {
            kind,
            d_in,
            d_out,
            w_self: None,
            w_neigh: None,
            bias: None,
            gamma: None,
            beta: None,
            attention: None,
            relations: Vec::new(),
            bases: None,
        }
    }

    /// The shape of the stage's attention: GAT's own, or R-GAT's relations' (one shape for
    /// all of them); None for stages without.
    pub(crate) fn attention_shape(&self) -> Option<AttentionLayer> {
        self.attention
            .or_else(|| self.relations.first().and_then(|r| r.attention))
    }

    /// Whether a conv stage reads neighbour rows (through a weight, or per relation).
    pub(crate) fn reads_neighbours(&self) -> bool {
        matches!(self.kind, StageKind::Conv { .. })
            && (self.w_neigh.is_some() || !self.relations.is_empty())
    }

    /// Whether a conv stage transforms its rows before aggregating them: when that makes
    /// them narrower (or no wider), so the aggregation moves fewer columns.
    pub(crate) fn transforms_first(&self) -> bool {
        self.d_out <= self.d_in
    }

    /// The width of the rows this stage aggregates when it splits into a row-local half and
    /// an aggregation (see `Model::stage_neighbour_width`).
    pub(crate) fn neighbour_width(&self) -> Option<usize> {
        if self.transforms_first() {
            Some(self.d_out)
        } else if matches!(self.kind, StageKind::Conv { pre: true, .. }) {
            Some(self.d_in)
        } else {
            None
        }
    }

    /// The (output, input) rows of a conv stage on `ctx`: a linear layer (no neighbour
    /// weight) reads no halo rows.
    fn conv_rows<B: Backend>(&self, ctx: &StageCtx<'_, B>) -> (usize, usize) {
        if self.reads_neighbours() {
            (ctx.n_dst, ctx.n_src)
        } else {
            (ctx.n_dst, ctx.n_dst)
        }
    }
}

/// The block a stage runs on.
pub struct StageCtx<'a, B: Backend> {
    pub graph: &'a B::Graph,
    /// Typed models: the block split by relation, and each type's rows
    /// ([`crate::split_block`]); None for the others.
    pub typed: Option<&'a crate::RelationGraphs<B>>,
    /// Output rows of a conv stage, and the rows a row-local stage processes.
    pub n_dst: usize,
    /// Input rows of a conv stage (`>= n_dst`).
    pub n_src: usize,
    /// Global vertex ids of the `n_src` input rows (dropout masks).
    pub global_ids: &'a B::Index,
    /// `Some((seed, epoch))` in training; `None` evaluates with dropout off.
    pub train: Option<(u64, u64)>,
}

/// What a stage's backward needs from its forward.
pub struct StageCache<B: Backend> {
    /// The head's input after its pre-ops (conv stages do not keep theirs: backward
    /// recomputes it, see `Model::transform_input`).
    z: Option<B::Buf>,
    /// Aggregated `z` (aggregate-then-transform convolutions).
    agg: Option<B::Buf>,
    /// Pre-LayerNorm values of `post` norms (the conv output before norm).
    pre_norm: Option<B::Buf>,
    mean: Option<B::Buf>,
    rstd: Option<B::Buf>,
    /// Attention: the log-sum-exp of every destination and head.
    lse: Option<B::Buf>,
    /// Typed convolutions, per relation, what its backward reads: an aggregate-then-transform
    /// relation's aggregate of `z` on the destination type's rows, an R-GAT relation's
    /// log-sum-exp of every destination and head (None for a relation with no rows here, or
    /// that keeps nothing).
    relation_aggs: Vec<Option<B::Buf>>,
}

impl<B: Backend> StageCache<B> {
    pub(crate) fn push_relation_agg(&mut self, a: Option<B::Buf>) {
        self.relation_aggs.push(a);
    }

    pub(crate) fn relation_agg(&self, r: usize) -> Option<&B::Buf> {
        self.relation_aggs.get(r)?.as_ref()
    }

    fn empty() -> Self {
        StageCache {
            z: None,
            agg: None,
            pre_norm: None,
            mean: None,
            rstd: None,
            lse: None,
            relation_aggs: Vec::new(),
        }
    }
}

/// A conv stage's input after what runs before the convolution, with the pre-ops' LayerNorm
/// statistics (see `Model::transform_input`).
struct Transformed<B: Backend> {
    z: B::Buf,
    mean: Option<B::Buf>,
    rstd: Option<B::Buf>,
}

const LN_EPS: f32 = 1e-5;
/// GAT's LeakyReLU slope on attention logits.
const NEGATIVE_SLOPE: f32 = 0.2;
/// Added to a layer's dropout site for its attention dropout, so the coefficients' masks are
/// independent of the features'.
const ATTENTION_SITE: u32 = 1 << 16;

impl<B: Backend> Model<B> {
    fn dropout_key(&self, s: usize, train: Option<(u64, u64)>) -> Option<DropoutKey> {
        match train {
            Some((seed, epoch)) if self.config.dropout > 0.0 => Some(DropoutKey {
                seed,
                epoch,
                layer: s as u32,
            }),
            _ => None,
        }
    }

    /// What a conv stage runs on its first `rows` input rows (global ids `ids`) before the
    /// convolution: its pre-ops (with their LayerNorm statistics) or plain dropout (in
    /// training, `train`); None when neither applies.
    #[allow(clippy::too_many_arguments)]
    fn transform_input(
        &self,
        b: &B,
        st: &Stage,
        s: usize,
        input: &B::Buf,
        rows: usize,
        ids: &B::Index,
        train: Option<(u64, u64)>,
    ) -> Result<Option<Transformed<B>>> {
        if matches!(st.kind, StageKind::Conv { pre: true, .. }) {
            let (z, mean, rstd) = self.pre_ops(b, st, s, input, rows, ids, train)?;
            return Ok(Some(Transformed { z, mean, rstd }));
        }
        let Some(key) = self.dropout_key(s, train) else {
            return Ok(None);
        };
        let mut z = b.alloc(rows * st.d_in)?;
        b.dropout(input, &mut z, rows, st.d_in, ids, self.config.dropout, key)?;
        Ok(Some(Transformed {
            z,
            mean: None,
            rstd: None,
        }))
    }

    /// `norm? -> relu -> dropout?` on `rows` rows of `x` (row-local pre-ops of res+ blocks
    /// and the head). Returns the result and the LayerNorm statistics.
    #[allow(clippy::type_complexity, clippy::too_many_arguments)]
    fn pre_ops(
        &self,
        b: &B,
        st: &Stage,
        s: usize,
        x: &B::Buf,
        rows: usize,
        ids: &B::Index,
        train: Option<(u64, u64)>,
    ) -> Result<(B::Buf, Option<B::Buf>, Option<B::Buf>)> {
        let d = st.d_in;
        let n = rows * d;
        let mut u = b.alloc(n)?;
        let (mut mean, mut rstd) = (None, None);
        let mut r = b.alloc(n)?;
        if let (Some(g), Some(be)) = (st.gamma, st.beta) {
            let (mut m, mut rs) = (b.alloc(rows)?, b.alloc(rows)?);
            b.layer_norm(
                x,
                &self.params[g].value,
                &self.params[be].value,
                rows,
                d,
                LN_EPS,
                &mut u,
                &mut m,
                &mut rs,
            )?;
            b.relu(&u, &mut r, n)?;
            mean = Some(m);
            rstd = Some(rs);
        } else {
            b.relu(x, &mut r, n)?;
        }
        let z = match self.dropout_key(s, train) {
            Some(key) => {
                b.dropout(&r, &mut u, rows, d, ids, self.config.dropout, key)?;
                u
            }
            None => r,
        };
        Ok((z, mean, rstd))
    }

    /// Backward of [`Self::pre_ops`]: `gz` (gradient wrt its output) becomes the gradient wrt
    /// `x`. ReLU masks come from `z` (a dropped element already has zero gradient, and a kept
    /// one has the sign of the ReLU output).
    #[allow(clippy::too_many_arguments)]
    fn pre_ops_backward(
        &mut self,
        b: &B,
        st: &Stage,
        s: usize,
        x: &B::Buf,
        z: &B::Buf,
        mean: Option<&B::Buf>,
        rstd: Option<&B::Buf>,
        rows: usize,
        ids: &B::Index,
        train: Option<(u64, u64)>,
        mut gz: B::Buf,
    ) -> Result<B::Buf> {
        let d = st.d_in;
        if let Some(key) = self.dropout_key(s, train) {
            b.dropout_backward(&mut gz, rows, d, ids, self.config.dropout, key)?;
        }
        b.relu_backward(z, &mut gz, rows * d)?;
        match (st.gamma, st.beta, mean, rstd) {
            (Some(g), Some(be), Some(m), Some(rs)) => {
                let mut gx = b.alloc(rows * d)?;
                let (pg, pb) = two_mut(&mut self.params, g, be);
                b.layer_norm_backward(
                    &gz,
                    x,
                    &pg.value,
                    m,
                    rs,
                    rows,
                    d,
                    &mut gx,
                    &mut pg.grad,
                    &mut pb.grad,
                )?;
                Ok(gx)
            }
            _ => Ok(gz),
        }
    }

    /// Forward of stage `s`. `input` has `n_src` rows (conv) or `n_dst` rows (row-local) of
    /// `d_in` columns; the result has `n_dst` rows of `d_out` columns.
    pub fn forward_stage(
        &self,
        b: &B,
        s: usize,
        ctx: &StageCtx<'_, B>,
        input: &B::Buf,
    ) -> Result<(B::Buf, StageCache<B>)> {
        let st = &self.stages[s];
        let (d_in, d_out) = (st.d_in, st.d_out);
        let mut cache = StageCache::empty();
        match st.kind {
            StageKind::Encoder => {
                let rows = ctx.n_dst;
                let mut y = b.alloc(rows * d_out)?;
                let w = &self.params[st.w_self.unwrap()].value;
                b.gemm(false, false, rows, d_out, d_in, 1.0, input, w, 0.0, &mut y)?;
                if let Some(bias) = st.bias {
                    b.add_bias(&mut y, &self.params[bias].value, rows, d_out)?;
                }
                Ok((y, cache))
            }
            StageKind::Head => {
                let rows = ctx.n_dst;
                let (z, mean, rstd) =
                    self.pre_ops(b, st, s, input, rows, ctx.global_ids, ctx.train)?;
                let mut y = b.alloc(rows * d_out)?;
                let w = &self.params[st.w_self.unwrap()].value;
                b.gemm(false, false, rows, d_out, d_in, 1.0, &z, w, 0.0, &mut y)?;
                if let Some(bias) = st.bias {
                    b.add_bias(&mut y, &self.params[bias].value, rows, d_out)?;
                }
                cache.z = Some(z);
                cache.mean = mean;
                cache.rstd = rstd;
                Ok((y, cache))
            }
            StageKind::Conv { .. } => {
                let (n_dst, n_src) = st.conv_rows(ctx);
                // Pre-ops (norm, ReLU, dropout) or plain dropout over all input rows. Neither
                // result is kept for backward, which recomputes it from the input (kept anyway
                // as the previous layer's output): every step is deterministic and dropout
                // masks are a pure function of (seed, step, layer, vertex, column), so the
                // recomputation is bit-identical and one n_src x d_in tensor per layer is saved.
                let transformed =
                    self.transform_input(b, st, s, input, n_src, ctx.global_ids, ctx.train)?;
                let z = transformed.as_ref().map_or(input, |t| &t.z);
                let y = if let Some(at) = st.attention {
                    let mut y = b.alloc(n_dst * d_out)?;
                    let (t, _, scores) = self.attention_inputs(b, st, s, &at, z, n_src)?;
                    let mut lse = b.alloc(n_dst * at.heads)?;
                    let args = self.attention_args(&at, s, ctx, true);
                    b.attention_aggregate(ctx.graph, &t, &scores, &args, &mut y, &mut lse)?;
                    cache.lse = Some(lse);
                    y
                } else if !st.relations.is_empty() {
                    self.relation_terms(b, st, s, ctx, z, &mut cache)?
                } else {
                    let r = self.neighbour_rows(b, st, z, n_src)?;
                    let r = r.as_ref().unwrap_or(z);
                    self.aggregate_neighbours(b, st, ctx.graph, r, n_dst, &mut cache)?
                };
                self.finish_conv(b, st, n_dst, input, z, y, cache)
            }
        }
    }

    /// What a non-attention conv stage aggregates, row by row from its transformed input `z`:
    /// `z W_neigh` when it transforms before aggregating (the narrow side, `d_out <= d_in`),
    /// `None` when it aggregates `z` itself (or has no neighbour weight).
    fn neighbour_rows(&self, b: &B, st: &Stage, z: &B::Buf, rows: usize) -> Result<Option<B::Buf>> {
        match st.w_neigh {
            Some(wn) if st.transforms_first() => {
                let mut t = b.alloc(rows * st.d_out)?;
                let wn = &self.params[wn].value;
                b.gemm(
                    false, false, rows, st.d_out, st.d_in, 1.0, z, wn, 0.0, &mut t,
                )?;
                Ok(Some(t))
            }
            _ => Ok(None),
        }
    }

    /// The neighbour term of a non-attention conv stage (`n_dst x d_out`) from the rows `r`
    /// of [`Self::neighbour_rows`] (or `z`) over `graph`: aggregated, then transformed when
    /// the stage aggregates first (keeping the aggregate for backward); zero without a
    /// neighbour weight.
    fn aggregate_neighbours(
        &self,
        b: &B,
        st: &Stage,
        graph: &B::Graph,
        r: &B::Buf,
        n_dst: usize,
        cache: &mut StageCache<B>,
    ) -> Result<B::Buf> {
        let (d_in, d_out) = (st.d_in, st.d_out);
        let mut y = b.alloc(n_dst * d_out)?;
        if let Some(wn) = st.w_neigh {
            let wn = &self.params[wn].value;
            if st.transforms_first() {
                b.aggregate(graph, r, d_out, &mut y)?;
            } else {
                let mut a = b.alloc(n_dst * d_in)?;
                b.aggregate(graph, r, d_in, &mut a)?;
                b.gemm(false, false, n_dst, d_out, d_in, 1.0, &a, wn, 0.0, &mut y)?;
                cache.agg = Some(a);
            }
        }
        Ok(y)
    }

    /// The rest of a conv stage given its neighbour term `y`: the self term from the first
    /// `n_dst` rows of `z`, bias, residual (the first `n_dst` rows of `input`) and the post
    /// norm and ReLU.
    #[allow(clippy::too_many_arguments)]
    fn finish_conv(
        &self,
        b: &B,
        st: &Stage,
        n_dst: usize,
        input: &B::Buf,
        z: &B::Buf,
        mut y: B::Buf,
        mut cache: StageCache<B>,
    ) -> Result<(B::Buf, StageCache<B>)> {
        let (d_in, d_out) = (st.d_in, st.d_out);
        let StageKind::Conv { post, residual, .. } = st.kind else {
            unreachable!("finish_conv runs on conv stages")
        };
        if let Some(ws) = st.w_self {
            let beta = if st.reads_neighbours() { 1.0 } else { 0.0 };
            let ws = &self.params[ws].value;
            b.gemm(false, false, n_dst, d_out, d_in, 1.0, z, ws, beta, &mut y)?;
        }
        let n = n_dst * d_out;
        let norm = st.gamma.is_some() && st.beta.is_some();
        if let (true, false, false, Some(bias)) = (post, residual, norm, st.bias) {
            // The usual hidden layer: bias and ReLU in one pass over the rows.
            let mut out = b.alloc(n)?;
            b.bias_relu(&y, &self.params[bias].value, &mut out, n_dst, d_out)?;
            return Ok((out, cache));
        }
        if let Some(bias) = st.bias {
            b.add_bias(&mut y, &self.params[bias].value, n_dst, d_out)?;
        }
        if residual {
            b.axpy(1.0, input, &mut y, n_dst * d_out)?;
        }
        if !post {
            return Ok((y, cache));
        }
        let mut out = b.alloc(n)?;
        if let (Some(g), Some(be)) = (st.gamma, st.beta) {
            let (mut m, mut rs) = (b.alloc(n_dst)?, b.alloc(n_dst)?);
            let mut u = b.alloc(n)?;
            b.layer_norm(
                &y,
                &self.params[g].value,
                &self.params[be].value,
                n_dst,
                d_out,
                LN_EPS,
                &mut u,
                &mut m,
                &mut rs,
            )?;
            b.relu(&u, &mut out, n)?;
            cache.pre_norm = Some(y);
            cache.mean = Some(m);
            cache.rstd = Some(rs);
        } else {
            b.relu(&y, &mut out, n)?;
        }
        Ok((out, cache))
    }

    /// True when layer-wise inference may split stage `s` ([`Self::stage_neighbour_rows`],
    /// [`Self::forward_stage_split`]): a conv stage that reads neighbours through a weight
    /// (attention stages do not split; their blocks run [`Self::forward_stage`] whole).
    pub fn stage_splits(&self, s: usize) -> bool {
        let st = &self.stages[s];
        matches!(st.kind, StageKind::Conv { .. }) && st.w_neigh.is_some() && st.attention.is_none()
    }

    /// Columns of [`Self::stage_neighbour_rows`] of a splitting stage `s`, or `None` when
    /// they are its input rows themselves (no pre-ops, and it aggregates before transforming).
    pub fn stage_neighbour_width(&self, s: usize) -> Option<usize> {
        self.stages[s].neighbour_width()
    }

    /// The row-local half of a splitting stage `s` in evaluation: the rows its convolution
    /// aggregates, computed from `rows` input rows (global ids `ids`), once per vertex for a
    /// whole-graph pass; `None` exactly when [`Self::stage_neighbour_width`] is. Together with
    /// [`Self::forward_stage_split`] this is [`Self::forward_stage`] with dropout off, but a
    /// block gathers its sources' aggregated rows (often narrower than the input) instead of
    /// transforming every halo row again.
    pub fn stage_neighbour_rows(
        &self,
        b: &B,
        s: usize,
        input: &B::Buf,
        rows: usize,
        ids: &B::Index,
    ) -> Result<Option<B::Buf>> {
        let st = &self.stages[s];
        let transformed = self
            .transform_input(b, st, s, input, rows, ids, None)?
            .map(|t| t.z);
        let z = transformed.as_ref().unwrap_or(input);
        match self.neighbour_rows(b, st, z, rows)? {
            Some(t) => Ok(Some(t)),
            None => Ok(transformed),
        }
    }

    /// The neighbour half of a splitting stage `s` in evaluation on the block `ctx`: its
    /// destinations' input rows `input_dst` (the first `n_dst` rows are read, so the gathered
    /// rows serve when they are the input itself) and its `n_src` sources' rows `r_src` of
    /// [`Self::stage_neighbour_rows`] (destinations first, as in every block).
    pub fn forward_stage_split(
        &self,
        b: &B,
        s: usize,
        ctx: &StageCtx<'_, B>,
        input_dst: &B::Buf,
        r_src: &B::Buf,
    ) -> Result<B::Buf> {
        let st = &self.stages[s];
        assert!(ctx.train.is_none(), "split stages run in evaluation only");
        let transformed = self
            .transform_input(b, st, s, input_dst, ctx.n_dst, ctx.global_ids, None)?
            .map(|t| t.z);
        let z = transformed.as_ref().unwrap_or(input_dst);
        let mut cache = StageCache::empty();
        let y = self.aggregate_neighbours(b, st, ctx.graph, r_src, ctx.n_dst, &mut cache)?;
        Ok(self
            .finish_conv(b, st, ctx.n_dst, input_dst, z, y, cache)?
            .0)
    }

    /// The arguments for the attention operations of stage `s` on `ctx`: dropout on the
    /// coefficients in training, at the model's rate, on its own site; a self-loop per
    /// destination for GAT, none for R-GAT's relations.
    pub(crate) fn attention_args<'a>(
        &self,
        at: &AttentionLayer,
        s: usize,
        ctx: &StageCtx<'a, B>,
        self_loops: bool,
    ) -> Attention<'a, B::Index> {
        Attention {
            heads: at.heads,
            head_dim: at.head_dim,
            concat: at.concat,
            negative_slope: NEGATIVE_SLOPE,
            self_loops,
            dropout: self.dropout_key(s, ctx.train).map(|key| AttentionDropout {
                global_ids: ctx.global_ids,
                p: self.config.dropout,
                key: DropoutKey {
                    layer: key.layer + ATTENTION_SITE,
                    ..key
                },
            }),
        }
    }

    /// `t = z W` for the `n_src` input rows, the block-diagonal matrix `A` of the attention
    /// vectors (see [`AttentionLayer::positions`]) and the scores `t A` (`n_src x 2 heads`).
    /// Backward recomputes all three rather than keeping them.
    #[allow(clippy::too_many_arguments)]
    fn attention_inputs(
        &self,
        b: &B,
        st: &Stage,
        s: usize,
        at: &AttentionLayer,
        z: &B::Buf,
        n_src: usize,
    ) -> Result<(B::Buf, B::Buf, B::Buf)> {
        let c = at.heads * at.head_dim;
        let w = st.w_neigh.expect("attention maps rows with w_neigh");
        let mut t = b.alloc(n_src * c)?;
        let wv = &self.params[w].value;
        b.gemm(false, false, n_src, c, st.d_in, 1.0, z, wv, 0.0, &mut t)?;
        let (a, scores) = self.attention_scores(b, s, at, &t, n_src)?;
        Ok((t, a, scores))
    }

    /// The block-diagonal matrix `A` of `at`'s attention vectors in stage `s` and the scores
    /// `t A` (`n_src x 2 heads`) of the mapped rows `t`.
    pub(crate) fn attention_scores(
        &self,
        b: &B,
        s: usize,
        at: &AttentionLayer,
        t: &B::Buf,
        n_src: usize,
    ) -> Result<(B::Buf, B::Buf)> {
        let (c, h2) = (at.heads * at.head_dim, 2 * at.heads);
        let mut a = b.alloc(c * h2)?;
        let [src_pos, dst_pos] = self.att_positions[s]
            .as_ref()
            .expect("attention stages have their positions");
        b.scatter_add_rows(&self.params[at.att_src].value, 1, src_pos, &mut a)?;
        b.scatter_add_rows(&self.params[at.att_dst].value, 1, dst_pos, &mut a)?;
        let mut scores = b.alloc(n_src * h2)?;
        b.gemm(false, false, n_src, h2, c, 1.0, t, &a, 0.0, &mut scores)?;
        Ok((a, scores))
    }

    /// Adds the gradients of `at`'s attention vectors, the diagonal blocks of `tᵀ gscores`.
    pub(crate) fn attention_vector_grads(
        &mut self,
        b: &B,
        s: usize,
        at: &AttentionLayer,
        t: &B::Buf,
        gscores: &B::Buf,
        n_src: usize,
    ) -> Result<()> {
        let (c, h2) = (at.heads * at.head_dim, 2 * at.heads);
        let mut ga = b.alloc(c * h2)?;
        b.gemm(true, false, c, h2, n_src, 1.0, t, gscores, 0.0, &mut ga)?;
        let [src_pos, dst_pos] = self.att_positions[s]
            .as_ref()
            .expect("attention stages have their positions");
        let mut gv = b.alloc(c)?;
        for (pos, p) in [(src_pos, at.att_src), (dst_pos, at.att_dst)] {
            b.gather_rows(&ga, 1, pos, &mut gv)?;
            b.axpy(1.0, &gv, &mut self.params[p].grad, c)?;
        }
        Ok(())
    }

    /// `grad(W) += xᵀ g` for the linear map `y = x W` (`x` is `rows x d_in`, `g` = dL/dy).
    #[allow(clippy::too_many_arguments)]
    pub(crate) fn accumulate_weight_grad(
        &mut self,
        b: &B,
        w: usize,
        x: &B::Buf,
        g: &B::Buf,
        rows: usize,
        d_in: usize,
        d_out: usize,
    ) -> Result<()> {
        b.gemm(
            true,
            false,
            d_in,
            d_out,
            rows,
            1.0,
            x,
            g,
            1.0,
            &mut self.params[w].grad,
        )
    }

    /// `out = g Wᵀ + beta * out`: the gradient of the input of the linear map `y = x W`
    /// (`beta = 1` adds to a gradient already there).
    #[allow(clippy::too_many_arguments)]
    pub(crate) fn input_grad(
        &self,
        b: &B,
        w: usize,
        g: &B::Buf,
        rows: usize,
        d_in: usize,
        d_out: usize,
        beta: f32,
        out: &mut B::Buf,
    ) -> Result<()> {
        b.gemm(
            false,
            true,
            rows,
            d_in,
            d_out,
            1.0,
            g,
            &self.params[w].value,
            beta,
            out,
        )
    }

    /// Backward of stage `s`: adds this stage's weight gradients into [`Param::grad`] and
    /// returns the gradient wrt its input (`n_src` rows for conv stages, halo rows holding
    /// partial gradients for their owners), or `None` when `input_grad` is false (the first
    /// stage: nobody needs the gradient of the features). `output` is what
    /// [`Self::forward_stage`] returned (only its first `n_dst` rows are read).
    #[allow(clippy::too_many_arguments)]
    pub fn backward_stage(
        &mut self,
        b: &B,
        s: usize,
        ctx: &StageCtx<'_, B>,
        input: &B::Buf,
        output: &B::Buf,
        cache: StageCache<B>,
        grad_out: B::Buf,
        input_grad: bool,
    ) -> Result<Option<B::Buf>> {
        let st = self.stages[s].clone();
        let (d_in, d_out) = (st.d_in, st.d_out);
        match st.kind {
            StageKind::Encoder => {
                let rows = ctx.n_dst;
                let wi = st.w_self.unwrap();
                self.accumulate_weight_grad(b, wi, input, &grad_out, rows, d_in, d_out)?;
                if let Some(bias) = st.bias {
                    b.col_sum(&grad_out, rows, d_out, 1.0, &mut self.params[bias].grad)?;
                }
                if !input_grad {
                    return Ok(None);
                }
                let mut gx = b.alloc(rows * d_in)?;
                self.input_grad(b, wi, &grad_out, rows, d_in, d_out, 0.0, &mut gx)?;
                Ok(Some(gx))
            }
            StageKind::Head => {
                let rows = ctx.n_dst;
                let wi = st.w_self.unwrap();
                let z = cache.z.as_ref().expect("head caches its input");
                self.accumulate_weight_grad(b, wi, z, &grad_out, rows, d_in, d_out)?;
                if let Some(bias) = st.bias {
                    b.col_sum(&grad_out, rows, d_out, 1.0, &mut self.params[bias].grad)?;
                }
                let mut gz = b.alloc(rows * d_in)?;
                self.input_grad(b, wi, &grad_out, rows, d_in, d_out, 0.0, &mut gz)?;
                let gx = self.pre_ops_backward(
                    b,
                    &st,
                    s,
                    input,
                    z,
                    cache.mean.as_ref(),
                    cache.rstd.as_ref(),
                    rows,
                    ctx.global_ids,
                    ctx.train,
                    gz,
                )?;
                Ok(Some(gx))
            }
            StageKind::Conv {
                pre,
                post,
                residual,
            } => {
                let (n_dst, n_src) = st.conv_rows(ctx);
                let mut g = grad_out;
                if post {
                    let n = n_dst * d_out;
                    b.relu_backward(output, &mut g, n)?;
                    if let (Some(gi), Some(bi), Some(y)) = (st.gamma, st.beta, &cache.pre_norm) {
                        let mut gy = b.alloc(n)?;
                        let (pg, pb) = two_mut(&mut self.params, gi, bi);
                        b.layer_norm_backward(
                            &g,
                            y,
                            &pg.value,
                            cache.mean.as_ref().unwrap(),
                            cache.rstd.as_ref().unwrap(),
                            n_dst,
                            d_out,
                            &mut gy,
                            &mut pg.grad,
                            &mut pb.grad,
                        )?;
                        g = gy;
                    }
                }
                if let Some(bias) = st.bias {
                    b.col_sum(&g, n_dst, d_out, 1.0, &mut self.params[bias].grad)?;
                }
                // Recompute what forward_stage did to the input (see there).
                let transformed =
                    self.transform_input(b, &st, s, input, n_src, ctx.global_ids, ctx.train)?;
                let z = transformed.as_ref().map_or(input, |t| &t.z);
                let need_gz = input_grad || pre;
                let mut gz: Option<B::Buf> = None;
                if let Some(at) = st.attention {
                    let (c, h2) = (at.heads * at.head_dim, 2 * at.heads);
                    let (t, a, scores) = self.attention_inputs(b, &st, s, &at, z, n_src)?;
                    let lse = cache
                        .lse
                        .as_ref()
                        .expect("attention caches its log-sum-exp");
                    let args = self.attention_args(&at, s, ctx, true);
                    let mut gt = b.alloc(n_src * c)?;
                    let mut gscores = b.alloc(n_src * h2)?;
                    let mut scratch = b.alloc(n_dst * at.heads)?;
                    b.attention_aggregate_backward(
                        ctx.graph,
                        &t,
                        &scores,
                        lse,
                        &args,
                        &g,
                        &mut gt,
                        &mut gscores,
                        &mut scratch,
                    )?;
                    self.attention_vector_grads(b, s, &at, &t, &gscores, n_src)?;
                    // Through the scores into t, then through t = z W.
                    b.gemm(false, true, n_src, c, h2, 1.0, &gscores, &a, 1.0, &mut gt)?;
                    let w = st.w_neigh.expect("attention maps rows with w_neigh");
                    self.accumulate_weight_grad(b, w, z, &gt, n_src, d_in, c)?;
                    if need_gz {
                        let mut buf = b.alloc(n_src * d_in)?;
                        self.input_grad(b, w, &gt, n_src, d_in, c, 0.0, &mut buf)?;
                        gz = Some(buf);
                    }
                } else if !st.relations.is_empty() {
                    gz = self.relation_terms_backward(b, &st, s, ctx, z, &g, &cache, need_gz)?;
                } else if let Some(wn) = st.w_neigh {
                    if st.transforms_first() {
                        let mut gt = b.alloc(n_src * d_out)?;
                        b.aggregate_backward(ctx.graph, &g, d_out, &mut gt)?;
                        self.accumulate_weight_grad(b, wn, z, &gt, n_src, d_in, d_out)?;
                        if need_gz {
                            let mut buf = b.alloc(n_src * d_in)?;
                            self.input_grad(b, wn, &gt, n_src, d_in, d_out, 0.0, &mut buf)?;
                            gz = Some(buf);
                        }
                    } else {
                        let a = cache.agg.as_ref().expect("aggregate-first caches agg");
                        self.accumulate_weight_grad(b, wn, a, &g, n_dst, d_in, d_out)?;
                        if need_gz {
                            let mut ga = b.alloc(n_dst * d_in)?;
                            self.input_grad(b, wn, &g, n_dst, d_in, d_out, 0.0, &mut ga)?;
                            let mut buf = b.alloc(n_src * d_in)?;
                            b.aggregate_backward(ctx.graph, &ga, d_in, &mut buf)?;
                            gz = Some(buf);
                        }
                    }
                }
                if let Some(ws) = st.w_self {
                    self.accumulate_weight_grad(b, ws, z, &g, n_dst, d_in, d_out)?;
                    if need_gz {
                        let (buf, beta) = match gz.take() {
                            Some(buf) => (buf, 1.0),
                            None => (b.alloc(n_src * d_in)?, 0.0),
                        };
                        let mut buf = buf;
                        self.input_grad(b, ws, &g, n_dst, d_in, d_out, beta, &mut buf)?;
                        gz = Some(buf);
                    }
                }
                if !need_gz {
                    return Ok(None);
                }
                let mut gz = gz.expect("a conv stage has at least one weight");
                if pre {
                    let (mean, rstd) = transformed
                        .as_ref()
                        .map_or((None, None), |t| (t.mean.as_ref(), t.rstd.as_ref()));
                    gz = self.pre_ops_backward(
                        b,
                        &st,
                        s,
                        input,
                        z,
                        mean,
                        rstd,
                        n_src,
                        ctx.global_ids,
                        ctx.train,
                        gz,
                    )?;
                } else if let Some(key) = self.dropout_key(s, ctx.train) {
                    b.dropout_backward(
                        &mut gz,
                        n_src,
                        d_in,
                        ctx.global_ids,
                        self.config.dropout,
                        key,
                    )?;
                }
                if residual {
                    b.axpy(1.0, &g, &mut gz, n_dst * d_out)?;
                }
                Ok(Some(gz))
            }
        }
    }
}
