//! The [`Backend`] trait: every operation a GNN layer needs, on buffers that live wherever the
//! backend keeps them (host memory for the CPU backend, device memory for CUDA).
//!
//! Conventions shared by every implementation (the CPU backend is the reference; any other
//! backend must match it to float rounding):
//!
//! * Buffers hold `f32`, matrices are **row-major** and dense. Shapes are passed explicitly;
//!   an operation on an `m x n` matrix reads/writes the first `m * n` elements of its buffers
//!   (so "the first `n_dst` rows" of an `n_src x d` buffer is simply `m = n_dst`). A buffer
//!   shorter than what an operation needs is an [`EngineError::Shape`], never a panic.
//! * Index buffers hold `u32` (row ids, global vertex ids, labels).
//! * Operations may be asynchronous (CUDA streams); `download*`, [`Backend::sum_squares`],
//!   [`Backend::cross_entropy`] and [`Backend::synchronize`] return only when the work queued
//!   before them is done.
//! * Nothing here allocates behind the caller's back except `alloc`/`upload*`/`upload_graph`,
//!   so a model controls its peak memory.
//!
//! Determinism: dropout masks are a pure function of `(seed, epoch, layer, global vertex id,
//! column)` ([`dropout_keep`]), losses are sums over given rows divided by an explicit
//! normaliser, and aggregation normalisation comes from explicit scale vectors, so a graph
//! split over many devices reproduces the single-process numbers.

use thiserror::Error;

use crate::host::HostBuffer;

/// Errors raised by backends.
#[derive(Debug, Error)]
pub enum EngineError {
    /// Arguments whose sizes do not fit together (names the operation and the sizes).
    #[error("{op}: {message}")]
    Shape { op: &'static str, message: String },
    /// A graph block that is not well-formed (offsets, ids or scale vectors).
    #[error("invalid graph block: {0}")]
    Graph(String),
    /// Anything the device or its driver reported (CUDA errors, out of memory, ...).
    #[error("backend {backend}: {message}")]
    Device {
        backend: &'static str,
        message: String,
    },
}

pub type Result<T> = std::result::Result<T, EngineError>;

/// Helper for shape errors: `Err(shape("gemm", format!(..)))`.
pub fn shape_err(op: &'static str, message: impl Into<String>) -> EngineError {
    EngineError::Shape {
        op,
        message: message.into(),
    }
}

/// Checks that a buffer argument `what` of `op` holds at least `want` elements (buffers may
/// be longer than an operation uses). Every backend validates its arguments with this.
pub(crate) fn need(op: &'static str, what: &str, have: usize, want: usize) -> Result<()> {
    if have < want {
        Err(shape_err(
            op,
            format!("{what} has {have} elements, needs at least {want}"),
        ))
    } else {
        Ok(())
    }
}

/// A graph block on the host, ready to be uploaded with [`Backend::upload_graph`].
///
/// Destination rows `0..n_dst` aggregate from source rows `0..n_src` of the input matrix
/// (`n_src >= n_dst`; a device holds its own vertices first and halo vertices after, so the
/// destinations are a prefix of the sources). Row `v` of the CSR lists the *local* source ids
/// of the edges into `v` (same convention as `grandis_store::CsrView`).
///
/// The aggregation computed is
///
/// ```text
/// out[v] = dst_scale[v] * sum_{u in row v} src_scale[u] * x[u]  +  self_scale[v] * x[v]
/// ```
///
/// with `src_scale = None` meaning all ones and `self_scale = None` meaning no self term.
/// The scales are NOT derived from the local CSR: the caller passes global quantities
/// (global in-degree for mean, global degrees for GCN) so a partitioned run equals the full
/// graph exactly. [`crate::norm`] builds them for the single-process case.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct BlockGraph {
    pub n_dst: usize,
    pub n_src: usize,
    /// `n_dst + 1` offsets into `indices`.
    pub offsets: Vec<u64>,
    /// Local source ids, each `< n_src`.
    pub indices: Vec<u32>,
    /// Length `n_dst`.
    pub dst_scale: Vec<f32>,
    /// Length `n_src` when present.
    pub src_scale: Option<Vec<f32>>,
    /// Length `n_dst` when present.
    pub self_scale: Option<Vec<f32>>,
}

impl BlockGraph {
    pub fn num_edges(&self) -> usize {
        self.indices.len()
    }

    /// Checks every invariant listed on the type; backends call this in `upload_graph`.
    pub fn validate(&self) -> Result<()> {
        let bad = |m: String| Err(EngineError::Graph(m));
        if self.n_src < self.n_dst {
            return bad(format!(
                "n_src ({}) must be >= n_dst ({})",
                self.n_src, self.n_dst
            ));
        }
        if self.offsets.len() != self.n_dst + 1 {
            return bad(format!(
                "offsets has {} entries, expected n_dst + 1 = {}",
                self.offsets.len(),
                self.n_dst + 1
            ));
        }
        if self.offsets[0] != 0 || *self.offsets.last().unwrap() as usize != self.indices.len() {
            return bad(format!(
                "offsets must start at 0 and end at the number of indices ({})",
                self.indices.len()
            ));
        }
        if let Some(i) = self.offsets.windows(2).position(|w| w[0] > w[1]) {
            return bad(format!("offsets decrease at row {i}"));
        }
        if let Some(&u) = self.indices.iter().find(|&&u| u as usize >= self.n_src) {
            return bad(format!(
                "source id {u} out of range (n_src = {})",
                self.n_src
            ));
        }
        if self.dst_scale.len() != self.n_dst {
            return bad(format!(
                "dst_scale has {} entries, expected n_dst = {}",
                self.dst_scale.len(),
                self.n_dst
            ));
        }
        if let Some(s) = &self.src_scale {
            if s.len() != self.n_src {
                return bad(format!(
                    "src_scale has {} entries, expected n_src = {}",
                    s.len(),
                    self.n_src
                ));
            }
        }
        if let Some(s) = &self.self_scale {
            if s.len() != self.n_dst {
                return bad(format!(
                    "self_scale has {} entries, expected n_dst = {}",
                    s.len(),
                    self.n_dst
                ));
            }
        }
        Ok(())
    }
}

/// A CSR and its scale vectors as the kernels take them: above all the transpose of a
/// [`BlockGraph`] (row `u < n_src` lists the destinations whose rows contain `u`), which
/// backward aggregation runs over.
#[derive(Debug, Clone, PartialEq)]
pub struct ScaledCsr {
    pub(crate) offsets: Vec<u64>,
    pub(crate) indices: Vec<u32>,
    pub(crate) dst: Vec<f32>,
    pub(crate) src: Option<Vec<f32>>,
    pub(crate) self_: Option<Vec<f32>>,
}

/// `A^T` of a validated block, as every backend builds it: row `u < n_src` lists the
/// destinations `v` whose rows contain `u`, in increasing `v` (so sums run in the same
/// order everywhere); the scales swap roles and the self term exists only for `u < n_dst`.
pub(crate) fn transpose(g: &BlockGraph) -> ScaledCsr {
    let mut offsets = vec![0u64; g.n_src + 1];
    for &u in &g.indices {
        offsets[u as usize + 1] += 1;
    }
    for i in 0..g.n_src {
        offsets[i + 1] += offsets[i];
    }
    let mut cursor = offsets.clone();
    let mut indices = vec![0u32; g.indices.len()];
    for v in 0..g.n_dst {
        for &u in &g.indices[g.offsets[v] as usize..g.offsets[v + 1] as usize] {
            let slot = &mut cursor[u as usize];
            indices[*slot as usize] = v as u32;
            *slot += 1;
        }
    }
    ScaledCsr {
        offsets,
        indices,
        dst: g.src_scale.clone().unwrap_or_else(|| vec![1.0; g.n_src]),
        src: Some(g.dst_scale.clone()),
        self_: g.self_scale.as_ref().map(|s| {
            let mut full = s.clone();
            full.resize(g.n_src, 0.0);
            full
        }),
    }
}

/// A validated block and its transpose, both built on the host by any thread, before the
/// upload ([`Backend::upload_prepared`]): what lets a step's producer, not the rank that
/// runs it, pay for checking and transposing its blocks.
#[derive(Debug, Clone, PartialEq)]
pub struct PreparedGraph {
    graph: BlockGraph,
    transpose: ScaledCsr,
}

impl PreparedGraph {
    /// Checks `graph` ([`BlockGraph::validate`]) and builds its transpose.
    pub fn new(graph: BlockGraph) -> Result<PreparedGraph> {
        graph.validate()?;
        let transpose = transpose(&graph);
        Ok(PreparedGraph { graph, transpose })
    }

    pub fn graph(&self) -> &BlockGraph {
        &self.graph
    }

    pub fn transpose(&self) -> &ScaledCsr {
        &self.transpose
    }
}

/// Identifies one dropout application; together with a row's global vertex id and a column
/// it fixes the mask bit (see [`dropout_keep`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct DropoutKey {
    pub seed: u64,
    pub epoch: u64,
    /// Any id unique per dropout site in the model (layer index, or layer * k + site).
    pub layer: u32,
}

/// SplitMix64 finaliser (a bijection on u64 with good avalanche); device kernels must use the
/// same constants.
#[inline]
pub fn mix64(mut z: u64) -> u64 {
    z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    z ^ (z >> 31)
}

impl DropoutKey {
    /// The per-call stream value, computed once on the host and passed to kernels:
    /// `mix64(seed ^ mix64(epoch * 0x9E3779B97F4A7C15 + layer))` (wrapping arithmetic).
    pub fn stream(&self) -> u64 {
        mix64(
            self.seed
                ^ mix64(
                    self.epoch
                        .wrapping_mul(0x9E37_79B9_7F4A_7C15)
                        .wrapping_add(self.layer as u64),
                ),
        )
    }
}

/// Integer threshold for drop probability `p`: an element is kept iff its 24-bit hash is
/// `>= dropout_threshold(p)`. `p` is clamped to `[0, 1]`.
pub fn dropout_threshold(p: f32) -> u32 {
    (p.clamp(0.0, 1.0) as f64 * 16_777_216.0).round() as u32
}

/// The mask bit: keep iff `(mix64(stream ^ ((gid << 32) | col)) >> 40) >= threshold`.
/// Kept elements are multiplied by the f32 factor `1.0f32 / (1.0 - p)` in [`Backend::dropout`].
#[inline]
pub fn dropout_keep(stream: u64, threshold: u32, gid: u32, col: u32) -> bool {
    let h = mix64(stream ^ (((gid as u64) << 32) | col as u64));
    (h >> 40) as u32 >= threshold
}

/// The mask bit of attention dropout on the coefficient of edge `src -> dst` in head `head`
/// (global vertex ids): [`dropout_keep`] on a stream further keyed by the destination, so a
/// coefficient's bit is the same on whichever device computes that destination.
#[inline]
pub fn attention_keep(stream: u64, threshold: u32, dst_gid: u32, src_gid: u32, head: u32) -> bool {
    dropout_keep(
        attention_row_stream(stream, dst_gid),
        threshold,
        src_gid,
        head,
    )
}

/// The stream [`attention_keep`] draws the bits of destination `dst_gid`'s coefficients from
/// (kernels compute it once per destination).
#[inline]
pub fn attention_row_stream(stream: u64, dst_gid: u32) -> u64 {
    mix64(stream ^ dst_gid as u64)
}

/// What [`Backend::attention_aggregate`] computes besides the graph and the rows: GAT's
/// heads, how they are combined, and attention dropout.
pub struct Attention<'a, I> {
    pub heads: usize,
    /// Columns per head: the input has `heads * head_dim` columns.
    pub head_dim: usize,
    /// Concatenate the heads (`heads * head_dim` output columns) or average them (`head_dim`).
    pub concat: bool,
    /// Slope of the LeakyReLU on the attention logits (0.2 in GAT).
    pub negative_slope: f32,
    /// Inverted dropout on the normalised coefficients, in training.
    pub dropout: Option<AttentionDropout<'a, I>>,
}

/// Attention dropout: drop probability, key, and the global ids of the block's `n_src` rows
/// (the mask bit of an edge is [`attention_keep`] of its endpoints' global ids).
pub struct AttentionDropout<'a, I> {
    pub global_ids: &'a I,
    pub p: f32,
    pub key: DropoutKey,
}

impl<I> AttentionDropout<'_, I> {
    /// What the kernels need of it: the call's stream, the keep threshold and the factor of
    /// kept coefficients, `1 / (1 - p)`.
    pub fn mask_constants(&self) -> (u64, u32, f32) {
        (
            self.key.stream(),
            dropout_threshold(self.p),
            1.0 / (1.0 - self.p),
        )
    }
}

/// The gradients an attention backward overwrites: `(grad_x, grad_scores, scratch)`.
pub(crate) type AttentionGrads<'a, B> = (
    &'a <B as Backend>::Buf,
    &'a <B as Backend>::Buf,
    &'a <B as Backend>::Buf,
);

/// Checks the arguments of [`Backend::attention_aggregate`] (`out` is its output) and, with
/// `grads`, of [`Backend::attention_aggregate_backward`] (`out` is then `grad_out`), against
/// the block `graph`: every backend calls it before launching anything.
#[allow(clippy::too_many_arguments)]
pub(crate) fn check_attention<B: Backend + ?Sized>(
    b: &B,
    op: &'static str,
    graph: &B::Graph,
    att: &Attention<'_, B::Index>,
    x: &B::Buf,
    scores: &B::Buf,
    lse: &B::Buf,
    out: &B::Buf,
    grads: Option<AttentionGrads<'_, B>>,
) -> Result<()> {
    if att.heads == 0 || att.head_dim == 0 {
        return Err(shape_err(op, "heads and head_dim must be positive"));
    }
    if !(att.negative_slope.is_finite()) {
        return Err(shape_err(op, "negative_slope must be finite"));
    }
    let (n_dst, n_src, _) = b.graph_dims(graph);
    let elems = |rows: usize, cols: usize| {
        rows.checked_mul(cols)
            .ok_or_else(|| shape_err(op, format!("{rows} x {cols} overflows the address space")))
    };
    let h = att.heads;
    need(op, "x", b.len(x), elems(n_src, att.in_cols())?)?;
    need(op, "scores", b.len(scores), elems(n_src, 2 * h)?)?;
    need(op, "lse", b.len(lse), elems(n_dst, h)?)?;
    let out_name = if grads.is_some() { "grad_out" } else { "out" };
    need(op, out_name, b.len(out), elems(n_dst, att.out_cols())?)?;
    if let Some((grad_x, grad_scores, scratch)) = grads {
        need(op, "grad_x", b.len(grad_x), elems(n_src, att.in_cols())?)?;
        need(op, "grad_scores", b.len(grad_scores), elems(n_src, 2 * h)?)?;
        need(op, "scratch", b.len(scratch), elems(n_dst, h)?)?;
    }
    if let Some(d) = &att.dropout {
        if !(0.0..1.0).contains(&d.p) {
            return Err(shape_err(op, format!("p must be in [0, 1), got {}", d.p)));
        }
        need(op, "global_ids", b.index_len(d.global_ids), n_src)?;
    }
    Ok(())
}

impl<I> Attention<'_, I> {
    /// Columns of the input (and of its gradient).
    pub fn in_cols(&self) -> usize {
        self.heads * self.head_dim
    }
    /// Columns of the output.
    pub fn out_cols(&self) -> usize {
        if self.concat {
            self.in_cols()
        } else {
            self.head_dim
        }
    }
}

/// One Adam/AdamW step, with the step counter `t >= 1` (bias correction uses it).
///
/// Per element, with `g` the gradient and `w` the parameter:
///
/// ```text
/// if !decoupled { g = g + weight_decay * w }          // Adam with L2 penalty
/// m = beta1 * m + (1 - beta1) * g
/// v = beta2 * v + (1 - beta2) * g * g
/// m_hat = m / (1 - beta1^t);  v_hat = v / (1 - beta2^t)
/// if decoupled { w = w - lr * weight_decay * w }      // AdamW
/// w = w - lr * m_hat / (sqrt(v_hat) + eps)
/// ```
///
/// `grad_scale` multiplies `g` before anything else (global-norm clipping passes its factor
/// here so the gradient buffer need not be rewritten).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct AdamStep {
    pub lr: f32,
    pub beta1: f32,
    pub beta2: f32,
    pub eps: f32,
    pub weight_decay: f32,
    pub decoupled: bool,
    pub step: u64,
    pub grad_scale: f32,
}

/// A compute backend. All methods take `&self`: a backend is shared by the layers of a model,
/// and implementations use interior synchronisation where they need it.
pub trait Backend: Send + Sync {
    /// A dense `f32` buffer.
    type Buf: Send + Sync;
    /// A `u32` buffer (row ids, global vertex ids, labels).
    type Index: Send + Sync;
    /// An uploaded [`BlockGraph`] together with its transpose (built once, at upload, for the
    /// backward pass) and whatever per-edge data the backend precomputes.
    type Graph: Send + Sync;

    /// Short name for logs ("cpu", "cuda:0").
    fn name(&self) -> String;

    // ---- buffers -------------------------------------------------------------------------

    /// A zero-filled buffer of `len` elements.
    fn alloc(&self, len: usize) -> Result<Self::Buf>;
    /// Number of `f32` elements in `buf`.
    fn len(&self, buf: &Self::Buf) -> usize;
    /// A new buffer holding a copy of `host`.
    fn upload(&self, host: &[f32]) -> Result<Self::Buf>;
    /// A new buffer holding `host`'s data, which the caller no longer needs: a backend whose
    /// buffers are host memory keeps plain memory without a copy (and hands back an empty
    /// buffer), the others copy it (at full speed from page-locked memory) and hand it back
    /// for reuse.
    fn upload_host(&self, host: HostBuffer) -> Result<(Self::Buf, HostBuffer)> {
        Ok((self.upload(host.as_slice())?, host))
    }
    /// Copies `host` into `buf[offset .. offset + host.len()]` (used to fill halo rows).
    fn upload_into(&self, buf: &mut Self::Buf, offset: usize, host: &[f32]) -> Result<()>;
    /// Copies `buf[offset .. offset + out.len()]` to `out`; waits for queued work.
    fn download(&self, buf: &Self::Buf, offset: usize, out: &mut [f32]) -> Result<()>;
    /// A new index buffer holding a copy of `host`.
    fn upload_index(&self, host: &[u32]) -> Result<Self::Index>;
    /// Number of entries in an index buffer.
    fn index_len(&self, idx: &Self::Index) -> usize;
    /// Sets the first `len` elements of `buf` to `value`.
    fn fill(&self, buf: &mut Self::Buf, len: usize, value: f32) -> Result<()>;
    /// `dst[..len] = src[..len]`.
    fn copy(&self, src: &Self::Buf, dst: &mut Self::Buf, len: usize) -> Result<()> {
        self.copy_range(src, 0, dst, 0, len)
    }
    /// `dst[dst_at..dst_at + len] = src[src_at..src_at + len]`. `src` may belong to another
    /// backend of the same kind in this process (a rank on another stream or device): the
    /// device transports hand buffers between ranks and the receiver copies them into place.
    fn copy_range(
        &self,
        src: &Self::Buf,
        src_at: usize,
        dst: &mut Self::Buf,
        dst_at: usize,
        len: usize,
    ) -> Result<()>;
    /// Waits until all queued work is done (for timing).
    fn synchronize(&self) -> Result<()>;

    /// `out[i] = src[idx[i]]` row by row (`cols` columns, `index_len(idx)` rows): packs the
    /// rows another device needs before a download.
    fn gather_rows(
        &self,
        src: &Self::Buf,
        cols: usize,
        idx: &Self::Index,
        out: &mut Self::Buf,
    ) -> Result<()>;
    /// `out[idx[i]] += src[i]` row by row (`cols` columns, `index_len(idx)` rows; repeated
    /// ids add up): folds received halo gradients into the owner's rows.
    fn scatter_add_rows(
        &self,
        src: &Self::Buf,
        cols: usize,
        idx: &Self::Index,
        out: &mut Self::Buf,
    ) -> Result<()>;

    // ---- dense linear algebra ------------------------------------------------------------

    /// `C[m x n] = alpha * op(A) * op(B) + beta * C`, row-major, where `op(A)` is `m x k`
    /// (`A` is stored `k x m` when `trans_a`) and `op(B)` is `k x n` (`B` stored `n x k` when
    /// `trans_b`). With `beta == 0` the old contents of `C` are ignored (even NaN).
    #[allow(clippy::too_many_arguments)]
    fn gemm(
        &self,
        trans_a: bool,
        trans_b: bool,
        m: usize,
        n: usize,
        k: usize,
        alpha: f32,
        a: &Self::Buf,
        b: &Self::Buf,
        beta: f32,
        c: &mut Self::Buf,
    ) -> Result<()>;
    /// `x[r, j] += bias[j]` for the first `rows` rows of the `rows x cols` matrix `x`.
    fn add_bias(&self, x: &mut Self::Buf, bias: &Self::Buf, rows: usize, cols: usize)
        -> Result<()>;
    /// Column sums of the `rows x cols` matrix `x`: `out[j] = beta * out[j] + sum_r x[r, j]`
    /// (the bias gradient; `beta = 1` accumulates).
    fn col_sum(
        &self,
        x: &Self::Buf,
        rows: usize,
        cols: usize,
        beta: f32,
        out: &mut Self::Buf,
    ) -> Result<()>;

    // ---- graph aggregation ---------------------------------------------------------------

    /// Uploads a graph block (validated with [`BlockGraph::validate`]) and builds its
    /// transpose for [`Backend::aggregate_backward`].
    fn upload_graph(&self, graph: &BlockGraph) -> Result<Self::Graph>;
    /// Uploads a block checked and transposed ahead ([`PreparedGraph`]): the same graph as
    /// [`Backend::upload_graph`] of its block, with no host work left but the copies.
    fn upload_prepared(&self, graph: &PreparedGraph) -> Result<Self::Graph>;
    /// `(n_dst, n_src, num_edges)` of an uploaded graph.
    fn graph_dims(&self, graph: &Self::Graph) -> (usize, usize, usize);
    /// Forward aggregation (formula on [`BlockGraph`]): reads the `n_src x d` matrix `x`,
    /// overwrites the `n_dst x d` matrix `out`.
    fn aggregate(
        &self,
        graph: &Self::Graph,
        x: &Self::Buf,
        d: usize,
        out: &mut Self::Buf,
    ) -> Result<()>;
    /// Backward of [`Backend::aggregate`]: given `grad_out` (`n_dst x d`), OVERWRITES all
    /// `n_src x d` rows of `grad_x` with `A^T grad_out`, i.e.
    /// `grad_x[u] = src_scale[u] * sum_{v: u in row v} dst_scale[v] * grad_out[v]
    ///              + (u < n_dst ? self_scale[u] * grad_out[u] : 0)`.
    /// Halo rows (`u >= n_dst`) receive the partial gradients their owners must add up.
    fn aggregate_backward(
        &self,
        graph: &Self::Graph,
        grad_out: &Self::Buf,
        d: usize,
        grad_x: &mut Self::Buf,
    ) -> Result<()>;

    /// GAT's attention-weighted aggregation (PyG `GATConv` semantics: the block's own
    /// self-loops, edges `v -> v`, are skipped and every destination gets exactly one, after its
    /// other edges). For destination `v`, head `h`, over the sources `u` of row `v` and `v`:
    ///
    /// ```text
    /// e_u     = leaky_relu(scores[u, h] + scores[v, H + h], negative_slope)
    /// a_u     = exp(e_u - lse[v, h]),  lse[v, h] = max_u e_u + ln sum_u exp(e_u - max_u e_u)
    /// a'_u    = a_u * (attention_keep(..) ? 1 / (1 - p) : 0)        (dropout, training only)
    /// out[v, h * F + f] = sum_u a'_u x[u, h * F + f]                  (concat)
    /// out[v, f]         = (1 / H) sum_h sum_u a'_u x[u, h * F + f]    (mean)
    /// ```
    ///
    /// `x` is `n_src x (H * F)`, `scores` is `n_src x 2H` (columns `0..H`: the source terms
    /// `x_u · att_src[h]`; `H..2H`: the destination terms, read for `v < n_dst` only).
    /// OVERWRITES `out` (`n_dst x out_cols`) and `lse` (`n_dst x H`, for the backward).
    /// Sources are visited in row order, then the self-loop.
    #[allow(clippy::too_many_arguments)]
    fn attention_aggregate(
        &self,
        graph: &Self::Graph,
        x: &Self::Buf,
        scores: &Self::Buf,
        att: &Attention<'_, Self::Index>,
        out: &mut Self::Buf,
        lse: &mut Self::Buf,
    ) -> Result<()>;
    /// Backward of [`Backend::attention_aggregate`] (same arguments, `lse` from the forward):
    /// OVERWRITES `grad_x` (`n_src x (H * F)`) and `grad_scores` (`n_src x 2H`; the
    /// destination columns of halo rows are zero). Halo rows receive the partial gradients
    /// their owners must add up. Coefficients are recomputed from `scores` and `lse`, not
    /// stored; `scratch` (`n_dst x H`) holds one sum per destination and head between the
    /// destination pass and the source pass.
    #[allow(clippy::too_many_arguments)]
    fn attention_aggregate_backward(
        &self,
        graph: &Self::Graph,
        x: &Self::Buf,
        scores: &Self::Buf,
        lse: &Self::Buf,
        att: &Attention<'_, Self::Index>,
        grad_out: &Self::Buf,
        grad_x: &mut Self::Buf,
        grad_scores: &mut Self::Buf,
        scratch: &mut Self::Buf,
    ) -> Result<()>;

    // ---- element-wise and row-wise ops ---------------------------------------------------

    /// `out[i] = max(x[i], 0)` for `i < len`.
    fn relu(&self, x: &Self::Buf, out: &mut Self::Buf, len: usize) -> Result<()>;
    /// In place on the gradient: `grad[i] = if y[i] > 0 { grad[i] } else { 0 }`, where `y` is
    /// the ReLU *output* (or input: the sign is the same).
    fn relu_backward(&self, y: &Self::Buf, grad: &mut Self::Buf, len: usize) -> Result<()>;
    /// Inverted dropout on the `rows x cols` matrix `x`: `out = keep ? x / (1 - p) : 0` with
    /// the mask bit `dropout_keep(key.stream(), dropout_threshold(p), global_ids[r], c)`.
    /// `global_ids` has at least `rows` entries. `p == 0` copies; `p >= 1` is a shape error.
    #[allow(clippy::too_many_arguments)]
    fn dropout(
        &self,
        x: &Self::Buf,
        out: &mut Self::Buf,
        rows: usize,
        cols: usize,
        global_ids: &Self::Index,
        p: f32,
        key: DropoutKey,
    ) -> Result<()>;
    /// Backward of [`Backend::dropout`], in place on the gradient: the mask is recomputed from
    /// the same arguments, so nothing is stored between forward and backward.
    fn dropout_backward(
        &self,
        grad: &mut Self::Buf,
        rows: usize,
        cols: usize,
        global_ids: &Self::Index,
        p: f32,
        key: DropoutKey,
    ) -> Result<()>;
    /// `y[i] += alpha * x[i]` for `i < len` (residual connections, gradient accumulation).
    fn axpy(&self, alpha: f32, x: &Self::Buf, y: &mut Self::Buf, len: usize) -> Result<()>;
    /// `x[i] *= alpha` for `i < len`.
    fn scale(&self, x: &mut Self::Buf, alpha: f32, len: usize) -> Result<()>;
    /// Per-row LayerNorm with affine parameters:
    /// `out[r] = (x[r] - mean_r) * rstd_r * gamma + beta`, `rstd_r = 1 / sqrt(var_r + eps)`
    /// (biased variance). Saves `mean` and `rstd` (`rows` entries each) for the backward.
    #[allow(clippy::too_many_arguments)]
    fn layer_norm(
        &self,
        x: &Self::Buf,
        gamma: &Self::Buf,
        beta: &Self::Buf,
        rows: usize,
        cols: usize,
        eps: f32,
        out: &mut Self::Buf,
        mean: &mut Self::Buf,
        rstd: &mut Self::Buf,
    ) -> Result<()>;
    /// Backward of [`Backend::layer_norm`]: OVERWRITES `grad_x` (`rows x cols`) and
    /// ACCUMULATES into `grad_gamma` and `grad_beta` (`cols` each).
    #[allow(clippy::too_many_arguments)]
    fn layer_norm_backward(
        &self,
        grad_out: &Self::Buf,
        x: &Self::Buf,
        gamma: &Self::Buf,
        mean: &Self::Buf,
        rstd: &Self::Buf,
        rows: usize,
        cols: usize,
        grad_x: &mut Self::Buf,
        grad_gamma: &mut Self::Buf,
        grad_beta: &mut Self::Buf,
    ) -> Result<()>;

    // ---- loss ----------------------------------------------------------------------------

    /// Log-softmax + cross-entropy over the selected rows of the `n x classes` matrix
    /// `logits`: `rows[i]` is a local row id and `labels[i]` its class. OVERWRITES all
    /// `n x classes` of `grad` (zero outside the selected rows) with
    /// `(softmax(logits[r]) - onehot(label)) / normalizer` and returns
    /// `sum_i -log_softmax(logits[rows[i]])[labels[i]]` (NOT divided by `normalizer`), in
    /// f64. `normalizer` is the GLOBAL number of train vertices, so partial gradients from
    /// many devices add up to the exact total. Waits for queued work.
    #[allow(clippy::too_many_arguments)]
    fn cross_entropy(
        &self,
        logits: &Self::Buf,
        n: usize,
        classes: usize,
        rows: &Self::Index,
        labels: &Self::Index,
        normalizer: f32,
        grad: &mut Self::Buf,
    ) -> Result<f64>;

    // ---- optimizer -----------------------------------------------------------------------

    /// `sum_i x[i]^2` for `i < len`, accumulated in f64 (global-norm clipping: the caller
    /// sums this over parameters, all-reduced if distributed). Waits for queued work.
    fn sum_squares(&self, x: &Self::Buf, len: usize) -> Result<f64>;
    /// One Adam/AdamW update of the first `len` elements (formula on [`AdamStep`]).
    fn adam_step(
        &self,
        param: &mut Self::Buf,
        grad: &Self::Buf,
        m: &mut Self::Buf,
        v: &mut Self::Buf,
        len: usize,
        step: &AdamStep,
    ) -> Result<()>;
}
