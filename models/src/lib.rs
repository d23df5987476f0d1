//! GNN models of grandis (GraphSAGE with the mean aggregator, GCN, ResSAGE+ = DeeperGCN
//! `res+` blocks over SAGE convolutions, and a features-only MLP baseline) written against
//! [`grandis_engine::Backend`] with hand-derived backward passes.
//!
//! A model is a sequence of **stages**, each with its own forward and backward
//! ([`Model::forward_stage`], [`Model::backward_stage`]). A *conv* stage reads the `n_src`
//! rows of its input (the device's own vertices first, then halo vertices) and writes `n_dst`
//! output rows (own vertices only); a *row-local* stage (ResSAGE+ encoder and head) maps rows
//! to rows. A distributed runner therefore calls "stage s forward on this block", appends the
//! halo rows it received to the output, and calls stage s+1; in backward it gets the gradient
//! of all `n_src` input rows, sends the halo part to the owners and adds what it receives
//! ([`grandis_engine::Backend::scatter_add_rows`]) before calling stage s-1. Everything inside a
//! stage before the convolution (LayerNorm, ReLU, dropout) is row-local and its dropout mask is
//! keyed by global vertex id, so recomputing it on halo rows gives the owner's values.
//! Weight gradients are plain buffers ([`Param::grad`]) to be all-reduced before
//! [`Model::adam_step`]. The single-process trainer calls [`Model::forward`] /
//! [`Model::backward`], which run all stages on one block.
//!
//! Memory: a conv stage keeps only what its backward cannot recompute (the aggregated input
//! when it aggregates before transforming, post-norm values and statistics). What runs on its
//! input before the convolution (pre-norm, ReLU, dropout) is recomputed in backward from the
//! input, which the runner keeps anyway: every step is deterministic and dropout masks are a
//! pure function of their key, so this is bit-identical and saves one input-sized tensor per
//! layer, the largest one when halos are large.

use grandis_engine::{AdamStep, Backend, DropoutKey, Result};
use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;
use serde::{Deserialize, Serialize};

/// Which architecture: the job spec's own enum (one definition, in `grandis-wire`).
pub use grandis_wire::ModelKind;

/// The normalisation the graph blocks of `kind` must be built with.
pub fn aggregation(kind: ModelKind) -> grandis_engine::norm::Aggregation {
    match kind {
        ModelKind::Gcn => grandis_engine::norm::Aggregation::Gcn,
        _ => grandis_engine::norm::Aggregation::Mean,
    }
}

/// Everything that fixes a model's shape and initial weights.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ModelConfig {
    pub kind: ModelKind,
    /// Number of graph convolutions (linear layers for `Mlp`).
    pub layers: usize,
    pub in_dim: usize,
    pub hidden: usize,
    pub classes: usize,
    pub dropout: f32,
    /// LayerNorm between layers (always before the activation).
    pub layer_norm: bool,
    pub seed: u64,
}

impl ModelConfig {
    /// The model of a job for a dataset of `in_dim` features and `classes` classes.
    pub fn for_job(spec: &grandis_wire::JobSpec, in_dim: usize, classes: usize) -> ModelConfig {
        ModelConfig {
            kind: spec.model,
            layers: spec.layers as usize,
            in_dim,
            hidden: spec.hidden as usize,
            classes,
            dropout: spec.dropout as f32,
            layer_norm: spec.layer_norm,
            seed: spec.seed,
        }
    }

    pub fn validate(&self) -> std::result::Result<(), String> {
        if self.layers == 0 {
            return Err("layers must be at least 1".into());
        }
        if self.kind == ModelKind::ResSage && self.layers < 1 {
            return Err("ressage needs at least 1 layer".into());
        }
        if self.in_dim == 0 || self.classes == 0 {
            return Err(format!(
                "input dimension ({}) and classes ({}) must be positive",
                self.in_dim, self.classes
            ));
        }
        if self.hidden == 0 && (self.layers > 1 || self.kind == ModelKind::ResSage) {
            return Err("hidden must be positive".into());
        }
        if !(0.0..1.0).contains(&self.dropout) {
            return Err(format!("dropout must be in [0, 1), got {}", self.dropout));
        }
        Ok(())
    }
}

/// A trainable tensor with its gradient and Adam moments (all on the backend).
pub struct Param<B: Backend> {
    pub name: String,
    pub shape: Vec<usize>,
    pub value: B::Buf,
    pub grad: B::Buf,
    pub m: B::Buf,
    pub v: B::Buf,
}

impl<B: Backend> Param<B> {
    pub fn len(&self) -> usize {
        self.shape.iter().product()
    }
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum StageKind {
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
struct Stage {
    kind: StageKind,
    d_in: usize,
    d_out: usize,
    /// Indices into `Model::params`.
    w_self: Option<usize>,
    w_neigh: Option<usize>,
    bias: usize,
    gamma: Option<usize>,
    beta: Option<usize>,
}

/// The block a stage runs on.
pub struct StageCtx<'a, B: Backend> {
    pub graph: &'a B::Graph,
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
}

/// A conv stage's input after what runs before the convolution, with the pre-ops' LayerNorm
/// statistics (see `Model::transform_input`).
struct Transformed<B: Backend> {
    z: B::Buf,
    mean: Option<B::Buf>,
    rstd: Option<B::Buf>,
}

/// A model: configuration, parameters, stages.
pub struct Model<B: Backend> {
    pub config: ModelConfig,
    pub params: Vec<Param<B>>,
    stages: Vec<Stage>,
}

const LN_EPS: f32 = 1e-5;

impl<B: Backend> Model<B> {
    /// Builds the model with Glorot-uniform weights drawn from `config.seed` (zero biases,
    /// unit LayerNorm gains).
    pub fn new(b: &B, config: ModelConfig) -> anyhow::Result<Model<B>> {
        config
            .validate()
            .map_err(|e| anyhow::anyhow!("invalid model configuration: {e}"))?;
        let mut rng = ChaCha8Rng::seed_from_u64(config.seed ^ 0x6d6f_6465_6c73);
        let mut params: Vec<Param<B>> = Vec::new();
        let mut add = |b: &B, name: String, shape: Vec<usize>, init: Init| -> Result<usize> {
            let len: usize = shape.iter().product();
            let host: Vec<f32> = match init {
                Init::Glorot => {
                    let limit = (6.0 / (shape[0] + shape[1]) as f64).sqrt() as f32;
                    (0..len).map(|_| rng.gen_range(-limit..limit)).collect()
                }
                Init::Zeros => vec![0.0; len],
                Init::Ones => vec![1.0; len],
            };
            params.push(Param {
                name,
                shape,
                value: b.upload(&host)?,
                grad: b.alloc(len)?,
                m: b.alloc(len)?,
                v: b.alloc(len)?,
            });
            Ok(params.len() - 1)
        };
        let c = &config;
        let mut stages = Vec::new();
        let linear = |add: &mut AddParam<'_, B>,
                      s: usize,
                      name: &str,
                      d_in: usize,
                      d_out: usize|
         -> Result<usize> {
            add(
                b,
                format!("stage{s}.{name}"),
                vec![d_in, d_out],
                Init::Glorot,
            )
        };
        let norm = |add: &mut AddParam<'_, B>,
                    s: usize,
                    d: usize|
         -> Result<(Option<usize>, Option<usize>)> {
            if c.layer_norm {
                Ok((
                    Some(add(b, format!("stage{s}.ln_gamma"), vec![d], Init::Ones)?),
                    Some(add(b, format!("stage{s}.ln_beta"), vec![d], Init::Zeros)?),
                ))
            } else {
                Ok((None, None))
            }
        };
        match c.kind {
            ModelKind::Sage | ModelKind::Gcn | ModelKind::Mlp => {
                for l in 0..c.layers {
                    let d_in = if l == 0 { c.in_dim } else { c.hidden };
                    let last = l + 1 == c.layers;
                    let d_out = if last { c.classes } else { c.hidden };
                    let s = stages.len();
                    let (w_self, w_neigh) = match c.kind {
                        ModelKind::Sage => (
                            Some(linear(&mut add, s, "w_self", d_in, d_out)?),
                            Some(linear(&mut add, s, "w_neigh", d_in, d_out)?),
                        ),
                        ModelKind::Gcn => (None, Some(linear(&mut add, s, "weight", d_in, d_out)?)),
                        _ => (Some(linear(&mut add, s, "weight", d_in, d_out)?), None),
                    };
                    let bias = add(b, format!("stage{s}.bias"), vec![d_out], Init::Zeros)?;
                    let (gamma, beta) = if last {
                        (None, None)
                    } else {
                        norm(&mut add, s, d_out)?
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
            }
            ModelKind::ResSage => {
                let h = c.hidden;
                let w = linear(&mut add, 0, "weight", c.in_dim, h)?;
                let bias = add(b, "stage0.bias".into(), vec![h], Init::Zeros)?;
                stages.push(Stage {
                    kind: StageKind::Encoder,
                    d_in: c.in_dim,
                    d_out: h,
                    w_self: Some(w),
                    w_neigh: None,
                    bias,
                    gamma: None,
                    beta: None,
                });
                for l in 0..c.layers {
                    let s = stages.len();
                    let w_self = Some(linear(&mut add, s, "w_self", h, h)?);
                    let w_neigh = Some(linear(&mut add, s, "w_neigh", h, h)?);
                    let bias = add(b, format!("stage{s}.bias"), vec![h], Init::Zeros)?;
                    // The first convolution reads the encoder output directly (DeeperGCN).
                    let (gamma, beta) = if l == 0 {
                        (None, None)
                    } else {
                        norm(&mut add, s, h)?
                    };
                    stages.push(Stage {
                        kind: StageKind::Conv {
                            pre: l > 0,
                            post: false,
                            residual: l > 0,
                        },
                        d_in: h,
                        d_out: h,
                        w_self,
                        w_neigh,
                        bias,
                        gamma,
                        beta,
                    });
                }
                let s = stages.len();
                let (gamma, beta) = norm(&mut add, s, h)?;
                let w = linear(&mut add, s, "weight", h, c.classes)?;
                let bias = add(b, format!("stage{s}.bias"), vec![c.classes], Init::Zeros)?;
                stages.push(Stage {
                    kind: StageKind::Head,
                    d_in: h,
                    d_out: c.classes,
                    w_self: Some(w),
                    w_neigh: None,
                    bias,
                    gamma,
                    beta,
                });
            }
        }
        Ok(Model {
            config,
            params,
            stages,
        })
    }

    pub fn num_stages(&self) -> usize {
        self.stages.len()
    }

    /// True for stages that read neighbour rows (the runner must supply halo rows first).
    pub fn stage_reads_neighbors(&self, s: usize) -> bool {
        matches!(self.stages[s].kind, StageKind::Conv { .. }) && self.stages[s].w_neigh.is_some()
    }

    /// `(d_in, d_out)` of stage `s`.
    pub fn stage_dims(&self, s: usize) -> (usize, usize) {
        (self.stages[s].d_in, self.stages[s].d_out)
    }

    pub fn num_parameters(&self) -> usize {
        self.params.iter().map(|p| p.len()).sum()
    }

    pub fn zero_grads(&mut self, b: &B) -> Result<()> {
        for p in &mut self.params {
            let n = p.len();
            b.fill(&mut p.grad, n, 0.0)?;
        }
        Ok(())
    }

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

    /// What a conv stage runs on its first `rows` input rows before the convolution: its
    /// pre-ops (with their LayerNorm statistics) or plain dropout; None when neither applies.
    fn transform_input(
        &self,
        b: &B,
        st: &Stage,
        s: usize,
        input: &B::Buf,
        rows: usize,
        ctx: &StageCtx<'_, B>,
    ) -> Result<Option<Transformed<B>>> {
        if matches!(st.kind, StageKind::Conv { pre: true, .. }) {
            let (z, mean, rstd) = self.pre_ops(b, st, s, input, rows, ctx.global_ids, ctx.train)?;
            return Ok(Some(Transformed { z, mean, rstd }));
        }
        let Some(key) = self.dropout_key(s, ctx.train) else {
            return Ok(None);
        };
        let mut z = b.alloc(rows * st.d_in)?;
        b.dropout(
            input,
            &mut z,
            rows,
            st.d_in,
            ctx.global_ids,
            self.config.dropout,
            key,
        )?;
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
        let mut cache = StageCache {
            z: None,
            agg: None,
            pre_norm: None,
            mean: None,
            rstd: None,
        };
        match st.kind {
            StageKind::Encoder => {
                let rows = ctx.n_dst;
                let mut y = b.alloc(rows * d_out)?;
                let w = &self.params[st.w_self.unwrap()].value;
                b.gemm(false, false, rows, d_out, d_in, 1.0, input, w, 0.0, &mut y)?;
                b.add_bias(&mut y, &self.params[st.bias].value, rows, d_out)?;
                Ok((y, cache))
            }
            StageKind::Head => {
                let rows = ctx.n_dst;
                let (z, mean, rstd) =
                    self.pre_ops(b, st, s, input, rows, ctx.global_ids, ctx.train)?;
                let mut y = b.alloc(rows * d_out)?;
                let w = &self.params[st.w_self.unwrap()].value;
                b.gemm(false, false, rows, d_out, d_in, 1.0, &z, w, 0.0, &mut y)?;
                b.add_bias(&mut y, &self.params[st.bias].value, rows, d_out)?;
                cache.z = Some(z);
                cache.mean = mean;
                cache.rstd = rstd;
                Ok((y, cache))
            }
            StageKind::Conv {
                pre: _,
                post,
                residual,
            } => {
                let (n_dst, n_src) = if st.w_neigh.is_some() {
                    (ctx.n_dst, ctx.n_src)
                } else {
                    // A linear layer needs no halo rows.
                    (ctx.n_dst, ctx.n_dst)
                };
                // Pre-ops (norm, ReLU, dropout) or plain dropout over all input rows. Neither
                // result is kept for backward, which recomputes it from the input (kept anyway
                // as the previous layer's output): every step is deterministic and dropout
                // masks are a pure function of (seed, step, layer, vertex, column), so the
                // recomputation is bit-identical and one n_src x d_in tensor per layer is saved.
                let transformed = self.transform_input(b, st, s, input, n_src, ctx)?;
                let z = transformed.as_ref().map_or(input, |t| &t.z);
                let mut y = b.alloc(n_dst * d_out)?;
                if let Some(wn) = st.w_neigh {
                    let wn = &self.params[wn].value;
                    if d_out <= d_in {
                        // Transform, then aggregate: the aggregation moves d_out columns.
                        let mut t = b.alloc(n_src * d_out)?;
                        b.gemm(false, false, n_src, d_out, d_in, 1.0, z, wn, 0.0, &mut t)?;
                        b.aggregate(ctx.graph, &t, d_out, &mut y)?;
                    } else {
                        let mut a = b.alloc(n_dst * d_in)?;
                        b.aggregate(ctx.graph, z, d_in, &mut a)?;
                        b.gemm(false, false, n_dst, d_out, d_in, 1.0, &a, wn, 0.0, &mut y)?;
                        cache.agg = Some(a);
                    }
                }
                if let Some(ws) = st.w_self {
                    let beta = if st.w_neigh.is_some() { 1.0 } else { 0.0 };
                    let ws = &self.params[ws].value;
                    b.gemm(false, false, n_dst, d_out, d_in, 1.0, z, ws, beta, &mut y)?;
                }
                b.add_bias(&mut y, &self.params[st.bias].value, n_dst, d_out)?;
                if residual {
                    b.axpy(1.0, input, &mut y, n_dst * d_out)?;
                }
                if post {
                    let n = n_dst * d_out;
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
                } else {
                    Ok((y, cache))
                }
            }
        }
    }

    /// `grad(W) += xᵀ g` for the linear map `y = x W` (`x` is `rows x d_in`, `g` = dL/dy).
    #[allow(clippy::too_many_arguments)]
    fn accumulate_weight_grad(
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
    fn input_grad(
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
                b.col_sum(&grad_out, rows, d_out, 1.0, &mut self.params[st.bias].grad)?;
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
                b.col_sum(&grad_out, rows, d_out, 1.0, &mut self.params[st.bias].grad)?;
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
                let (n_dst, n_src) = if st.w_neigh.is_some() {
                    (ctx.n_dst, ctx.n_src)
                } else {
                    (ctx.n_dst, ctx.n_dst)
                };
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
                b.col_sum(&g, n_dst, d_out, 1.0, &mut self.params[st.bias].grad)?;
                // Recompute what forward_stage did to the input (see there).
                let transformed = self.transform_input(b, &st, s, input, n_src, ctx)?;
                let z = transformed.as_ref().map_or(input, |t| &t.z);
                let need_gz = input_grad || pre;
                let mut gz: Option<B::Buf> = None;
                if let Some(wn) = st.w_neigh {
                    if d_out <= d_in {
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

    /// Runs every stage on one block (`n_dst == n_src`, the single-process case). Returns
    /// the logits and what [`Self::backward`] needs; pass `keep = false` to drop the caches
    /// (evaluation).
    pub fn forward(
        &self,
        b: &B,
        ctx: &StageCtx<'_, B>,
        features: &B::Buf,
        keep: bool,
    ) -> Result<(B::Buf, Tape<B>)> {
        let mut tape = Tape {
            outputs: Vec::new(),
            caches: Vec::new(),
        };
        let mut current: Option<B::Buf> = None;
        for s in 0..self.stages.len() {
            let input = current.as_ref().unwrap_or(features);
            let (out, cache) = self.forward_stage(b, s, ctx, input)?;
            if keep {
                if let Some(prev) = current.take() {
                    tape.outputs.push(prev);
                }
                tape.caches.push(cache);
            }
            current = Some(out);
        }
        Ok((current.expect("a model has at least one stage"), tape))
    }

    /// Backward through every stage given the gradient of the logits; parameter gradients
    /// are accumulated into [`Param::grad`] (call [`Self::zero_grads`] first).
    pub fn backward(
        &mut self,
        b: &B,
        ctx: &StageCtx<'_, B>,
        features: &B::Buf,
        logits: &B::Buf,
        tape: Tape<B>,
        grad_logits: B::Buf,
    ) -> Result<()> {
        let Tape {
            mut outputs,
            mut caches,
        } = tape;
        let mut grad = grad_logits;
        let mut output_owned: Option<B::Buf> = None;
        for s in (0..self.stages.len()).rev() {
            let cache = caches.pop().expect("tape has one cache per stage");
            let input_owned = if s > 0 { outputs.pop() } else { None };
            let input = input_owned.as_ref().unwrap_or(features);
            let output = output_owned.as_ref().unwrap_or(logits);
            let g = self.backward_stage(b, s, ctx, input, output, cache, grad, s > 0)?;
            output_owned = input_owned;
            match g {
                Some(g) => grad = g,
                None => break,
            }
        }
        Ok(())
    }

    /// Optional global-norm clipping factor: `min(1, max_norm / ||grad||)` over all
    /// parameters (`sum_sq` lets a distributed caller pass an all-reduced value).
    pub fn clip_factor(&self, b: &B, max_norm: Option<f32>) -> Result<f32> {
        let Some(max_norm) = max_norm else {
            return Ok(1.0);
        };
        let mut sum_sq = 0.0f64;
        for p in &self.params {
            sum_sq += b.sum_squares(&p.grad, p.len())?;
        }
        let norm = sum_sq.sqrt();
        Ok(if norm > max_norm as f64 {
            (max_norm as f64 / norm) as f32
        } else {
            1.0
        })
    }

    /// One optimizer step on every parameter (LayerNorm gains and biases included, as
    /// PyTorch's optimisers do by default).
    pub fn adam_step(&mut self, b: &B, step: &AdamStep) -> Result<()> {
        for p in &mut self.params {
            let n = p.len();
            b.adam_step(&mut p.value, &p.grad, &mut p.m, &mut p.v, n, step)?;
        }
        Ok(())
    }
}

/// Saved stage outputs (inputs of the next stage) and caches of one forward pass.
pub struct Tape<B: Backend> {
    outputs: Vec<B::Buf>,
    caches: Vec<StageCache<B>>,
}

type AddParam<'a, B> = dyn FnMut(&B, String, Vec<usize>, Init) -> Result<usize> + 'a;

enum Init {
    Glorot,
    Zeros,
    Ones,
}

fn two_mut<T>(v: &mut [T], a: usize, b: usize) -> (&mut T, &mut T) {
    assert!(a != b, "distinct parameters");
    if a < b {
        let (l, r) = v.split_at_mut(b);
        (&mut l[a], &mut r[0])
    } else {
        let (l, r) = v.split_at_mut(a);
        (&mut r[0], &mut l[b])
    }
}
