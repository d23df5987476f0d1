//! The [`Backend`] trait: every operation a GNN layer needs, on buffers that live wherever the
//! backend keeps them (host memory for the CPU backend, device memory for CUDA). Its methods
//! check their arguments, once, and hand them to the backend's [`Kernels`]; every `Kernels`
//! type is a `Backend` (a blanket implementation, so no backend can skip or restate a check).
//!
//! Conventions shared by every implementation (the CPU backend is the reference; any other
//! backend must match it to float rounding):
//!
//! * Buffers hold `f32`, matrices are **row-major** and dense. Shapes are passed explicitly;
//!   an operation on an `m x n` matrix reads/writes the first `m * n` elements of its buffers
//!   (so "the first `n_dst` rows" of an `n_src x d` buffer is simply `m = n_dst`). A buffer
//!   shorter than what an operation needs is an [`crate::EngineError::Shape`], never a panic.
//! * Index buffers hold `u32` (row ids, global vertex ids, labels).
//! * Operations may be asynchronous (CUDA streams); `download*`, [`Backend::sum_squares`],
//!   [`Backend::cross_entropy`] and [`Kernels::synchronize`] return only when the work queued
//!   before them is done.
//! * Nothing here allocates behind the caller's back except `alloc`/`upload*`/`upload_graph`,
//!   so a model controls its peak memory.
//!
//! Determinism: dropout masks are a pure function of `(seed, epoch, layer, global vertex id,
//! column)` ([`crate::dropout_keep`]), losses are sums over given rows divided by an explicit
//! normaliser, and aggregation normalisation comes from explicit scale vectors, so a graph
//! split over many devices reproduces the single-process numbers.

use crate::args::{AdamStep, Attention, DropoutKey};
use crate::block::{transpose, BlockGraph, PreparedGraph};
use crate::error::{elems, need, shape_err, Result};
use crate::kernels::{GemmShape, Kernels};

/// The operations of a compute backend, arguments checked: what models and runtimes call.
/// Implemented for every [`Kernels`] type; buffers, uploads and sizes are [`Kernels`]'
/// methods, reachable through this trait as its supertrait's.
pub trait Backend: Kernels {
    /// Copies `host` into `buf[offset .. offset + host.len()]` (used to fill halo rows).
    fn upload_into(&self, buf: &mut Self::Buf, offset: usize, host: &[f32]) -> Result<()> {
        need(
            "upload_into",
            "buffer",
            self.len(buf),
            end("upload_into", offset, host.len())?,
        )?;
        if host.is_empty() {
            return Ok(());
        }
        self.run_upload_into(buf, offset, host)
    }
    /// Copies `buf[offset .. offset + out.len()]` to `out`; waits for queued work.
    fn download(&self, buf: &Self::Buf, offset: usize, out: &mut [f32]) -> Result<()> {
        need(
            "download",
            "buffer",
            self.len(buf),
            end("download", offset, out.len())?,
        )?;
        self.run_download(buf, offset, out)
    }
    /// Sets the first `len` elements of `buf` to `value`.
    fn fill(&self, buf: &mut Self::Buf, len: usize, value: f32) -> Result<()> {
        need("fill", "buffer", self.len(buf), len)?;
        if len == 0 {
            return Ok(());
        }
        self.run_fill(buf, len, value)
    }
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
    ) -> Result<()> {
        need("copy", "src", self.len(src), end("copy", src_at, len)?)?;
        need("copy", "dst", self.len(dst), end("copy", dst_at, len)?)?;
        if len == 0 {
            return Ok(());
        }
        self.run_copy_range(src, src_at, dst, dst_at, len)
    }

    /// `out[i] = src[idx[i]]` row by row (`cols` columns, `index_len(idx)` rows): packs the
    /// rows another device needs before a download.
    fn gather_rows(
        &self,
        src: &Self::Buf,
        cols: usize,
        idx: &Self::Index,
        out: &mut Self::Buf,
    ) -> Result<()> {
        let op = "gather_rows";
        let n = elems(op, self.index_len(idx), cols)?;
        need(op, "out", self.len(out), n)?;
        rows_inside(op, "src", self.index_max(idx), cols, self.len(src))?;
        if n == 0 {
            return Ok(());
        }
        self.run_gather_rows(src, cols, idx, out)
    }
    /// `out[idx[i]] += src[i]` row by row (`cols` columns, `index_len(idx)` rows; repeated
    /// ids add up): folds received halo gradients into the owner's rows.
    fn scatter_add_rows(
        &self,
        src: &Self::Buf,
        cols: usize,
        idx: &Self::Index,
        out: &mut Self::Buf,
    ) -> Result<()> {
        let op = "scatter_add_rows";
        let n = elems(op, self.index_len(idx), cols)?;
        need(op, "src", self.len(src), n)?;
        rows_inside(op, "out", self.index_max(idx), cols, self.len(out))?;
        if n == 0 {
            return Ok(());
        }
        self.run_scatter_add_rows(src, cols, idx, out)
    }

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
    ) -> Result<()> {
        need("gemm", "A", self.len(a), elems("gemm", m, k)?)?;
        need("gemm", "B", self.len(b), elems("gemm", k, n)?)?;
        need("gemm", "C", self.len(c), elems("gemm", m, n)?)?;
        if m == 0 || n == 0 {
            return Ok(());
        }
        let shape = GemmShape {
            trans_a,
            trans_b,
            m,
            n,
            k,
            alpha,
            beta,
        };
        self.run_gemm(shape, a, b, c)
    }
    /// `x[r, j] += bias[j]` for the first `rows` rows of the `rows x cols` matrix `x`.
    fn add_bias(
        &self,
        x: &mut Self::Buf,
        bias: &Self::Buf,
        rows: usize,
        cols: usize,
    ) -> Result<()> {
        let n = elems("add_bias", rows, cols)?;
        need("add_bias", "x", self.len(x), n)?;
        need("add_bias", "bias", self.len(bias), cols)?;
        if n == 0 {
            return Ok(());
        }
        self.run_add_bias(x, bias, rows, cols)
    }
    /// Column sums of the `rows x cols` matrix `x`: `out[j] = beta * out[j] + sum_r x[r, j]`
    /// (the bias gradient; `beta = 1` accumulates).
    fn col_sum(
        &self,
        x: &Self::Buf,
        rows: usize,
        cols: usize,
        beta: f32,
        out: &mut Self::Buf,
    ) -> Result<()> {
        need("col_sum", "x", self.len(x), elems("col_sum", rows, cols)?)?;
        need("col_sum", "out", self.len(out), cols)?;
        if cols == 0 {
            return Ok(());
        }
        self.run_col_sum(x, rows, cols, beta, out)
    }

    // ---- graph aggregation ---------------------------------------------------------------

    /// Uploads a graph block (validated with [`BlockGraph::validate`]) and builds its
    /// transpose for [`Backend::aggregate_backward`].
    fn upload_graph(&self, graph: &BlockGraph) -> Result<Self::Graph> {
        graph.validate()?;
        self.upload_block(graph, &transpose(graph))
    }
    /// Uploads a block checked and transposed ahead ([`PreparedGraph`]): the same graph as
    /// [`Backend::upload_graph`] of its block, with no host work left but the copies.
    fn upload_prepared(&self, graph: &PreparedGraph) -> Result<Self::Graph> {
        self.upload_block(graph.graph(), graph.transpose())
    }
    /// Forward aggregation (formula on [`BlockGraph`]): reads the `n_src x d` matrix `x`,
    /// overwrites the `n_dst x d` matrix `out`.
    fn aggregate(
        &self,
        graph: &Self::Graph,
        x: &Self::Buf,
        d: usize,
        out: &mut Self::Buf,
    ) -> Result<()> {
        let op = "aggregate";
        let (n_dst, n_src, _) = self.graph_dims(graph);
        need(op, "x", self.len(x), elems(op, n_src, d)?)?;
        need(op, "out", self.len(out), elems(op, n_dst, d)?)?;
        if d == 0 {
            return Ok(());
        }
        self.run_aggregate(graph, x, d, out)
    }
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
    ) -> Result<()> {
        let op = "aggregate_backward";
        let (n_dst, n_src, _) = self.graph_dims(graph);
        need(op, "grad_out", self.len(grad_out), elems(op, n_dst, d)?)?;
        need(op, "grad_x", self.len(grad_x), elems(op, n_src, d)?)?;
        if d == 0 {
            return Ok(());
        }
        self.run_aggregate_backward(graph, grad_out, d, grad_x)
    }

    /// GAT's attention-weighted aggregation (PyG `GATConv` semantics: with
    /// [`Attention::self_loops`] the block's own self-loops, edges `v -> v`, are skipped and
    /// every destination gets exactly one, after its other edges; without, the row's edges as
    /// they are). For destination `v`, head `h`, over its sources `u`:
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
    /// OVERWRITES `out` (`n_dst x out_cols`) and `lse` (`n_dst x H`, for the backward; 0 for a
    /// destination without sources, whose output is 0). Sources are visited in row order, then
    /// the self-loop.
    #[allow(clippy::too_many_arguments)]
    fn attention_aggregate(
        &self,
        graph: &Self::Graph,
        x: &Self::Buf,
        scores: &Self::Buf,
        att: &Attention<'_, Self::Index>,
        out: &mut Self::Buf,
        lse: &mut Self::Buf,
    ) -> Result<()> {
        check_attention(
            self,
            "attention_aggregate",
            graph,
            att,
            x,
            scores,
            lse,
            out,
            None,
        )?;
        self.run_attention_aggregate(graph, x, scores, att, out, lse)
    }
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
    ) -> Result<()> {
        let grads = Some((&*grad_x, &*grad_scores, &*scratch));
        let op = "attention_aggregate_backward";
        check_attention(self, op, graph, att, x, scores, lse, grad_out, grads)?;
        self.run_attention_aggregate_backward(
            graph,
            x,
            scores,
            lse,
            att,
            grad_out,
            grad_x,
            grad_scores,
            scratch,
        )
    }

    // ---- element-wise and row-wise ops ---------------------------------------------------

    /// `out[i] = max(x[i], 0)` for `i < len`.
    fn relu(&self, x: &Self::Buf, out: &mut Self::Buf, len: usize) -> Result<()> {
        need("relu", "x", self.len(x), len)?;
        need("relu", "out", self.len(out), len)?;
        if len == 0 {
            return Ok(());
        }
        self.run_relu(x, out, len)
    }
    /// `out[r, j] = max(y[r, j] + bias[j], 0)` for the first `rows` rows of the `rows x cols`
    /// matrix `y`: [`Backend::add_bias`] then [`Backend::relu`] in one pass, the same bits,
    /// `y` left as it was.
    fn bias_relu(
        &self,
        y: &Self::Buf,
        bias: &Self::Buf,
        out: &mut Self::Buf,
        rows: usize,
        cols: usize,
    ) -> Result<()> {
        let n = elems("bias_relu", rows, cols)?;
        need("bias_relu", "y", self.len(y), n)?;
        need("bias_relu", "bias", self.len(bias), cols)?;
        need("bias_relu", "out", self.len(out), n)?;
        if n == 0 {
            return Ok(());
        }
        self.run_bias_relu(y, bias, out, rows, cols)
    }
    /// In place on the gradient: `grad[i] = if y[i] > 0 { grad[i] } else { 0 }`, where `y` is
    /// the ReLU *output* (or input: the sign is the same).
    fn relu_backward(&self, y: &Self::Buf, grad: &mut Self::Buf, len: usize) -> Result<()> {
        need("relu_backward", "y", self.len(y), len)?;
        need("relu_backward", "grad", self.len(grad), len)?;
        if len == 0 {
            return Ok(());
        }
        self.run_relu_backward(y, grad, len)
    }
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
    ) -> Result<()> {
        let op = "dropout";
        let n = elems(op, rows, cols)?;
        need(op, "x", self.len(x), n)?;
        need(op, "out", self.len(out), n)?;
        need(op, "global_ids", self.index_len(global_ids), rows)?;
        drop_probability(op, p)?;
        if n == 0 {
            return Ok(());
        }
        self.run_dropout(x, out, rows, cols, global_ids, p, key)
    }
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
    ) -> Result<()> {
        let op = "dropout_backward";
        let n = elems(op, rows, cols)?;
        need(op, "grad", self.len(grad), n)?;
        need(op, "global_ids", self.index_len(global_ids), rows)?;
        drop_probability(op, p)?;
        if n == 0 || p == 0.0 {
            return Ok(());
        }
        self.run_dropout_backward(grad, rows, cols, global_ids, p, key)
    }
    /// `y[i] += alpha * x[i]` for `i < len` (residual connections, gradient accumulation).
    fn axpy(&self, alpha: f32, x: &Self::Buf, y: &mut Self::Buf, len: usize) -> Result<()> {
        need("axpy", "x", self.len(x), len)?;
        need("axpy", "y", self.len(y), len)?;
        if len == 0 {
            return Ok(());
        }
        self.run_axpy(alpha, x, y, len)
    }
    /// `x[i] *= alpha` for `i < len`.
    fn scale(&self, x: &mut Self::Buf, alpha: f32, len: usize) -> Result<()> {
        need("scale", "x", self.len(x), len)?;
        if len == 0 {
            return Ok(());
        }
        self.run_scale(x, alpha, len)
    }
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
    ) -> Result<()> {
        let op = "layer_norm";
        let n = elems(op, rows, cols)?;
        need(op, "x", self.len(x), n)?;
        need(op, "out", self.len(out), n)?;
        need(op, "gamma", self.len(gamma), cols)?;
        need(op, "beta", self.len(beta), cols)?;
        need(op, "mean", self.len(mean), rows)?;
        need(op, "rstd", self.len(rstd), rows)?;
        if n == 0 {
            return Ok(());
        }
        self.run_layer_norm(x, gamma, beta, rows, cols, eps, out, mean, rstd)
    }
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
    ) -> Result<()> {
        let op = "layer_norm_backward";
        let n = elems(op, rows, cols)?;
        need(op, "grad_out", self.len(grad_out), n)?;
        need(op, "x", self.len(x), n)?;
        need(op, "grad_x", self.len(grad_x), n)?;
        need(op, "gamma", self.len(gamma), cols)?;
        need(op, "grad_gamma", self.len(grad_gamma), cols)?;
        need(op, "grad_beta", self.len(grad_beta), cols)?;
        need(op, "mean", self.len(mean), rows)?;
        need(op, "rstd", self.len(rstd), rows)?;
        if cols == 0 {
            return Ok(());
        }
        self.run_layer_norm_backward(
            grad_out, x, gamma, mean, rstd, rows, cols, grad_x, grad_gamma, grad_beta,
        )
    }

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
    ) -> Result<f64> {
        let op = "cross_entropy";
        let total = elems(op, n, classes)?;
        need(op, "logits", self.len(logits), total)?;
        need(op, "grad", self.len(grad), total)?;
        let (n_rows, n_labels) = (self.index_len(rows), self.index_len(labels));
        if n_rows != n_labels {
            return Err(shape_err(
                op,
                format!("{n_rows} rows but {n_labels} labels"),
            ));
        }
        if let Some(r) = self.index_max(rows).filter(|&r| r as usize >= n) {
            return Err(shape_err(op, format!("row {r} out of range (n = {n})")));
        }
        if let Some(l) = self.index_max(labels).filter(|&l| l as usize >= classes) {
            return Err(shape_err(
                op,
                format!("label {l} out of range ({classes} classes)"),
            ));
        }
        if normalizer.is_nan() || normalizer <= 0.0 {
            return Err(shape_err(
                op,
                format!("normalizer must be positive, got {normalizer}"),
            ));
        }
        self.run_cross_entropy(logits, n, classes, rows, labels, normalizer, grad)
    }

    // ---- optimizer -----------------------------------------------------------------------

    /// `sum_i x[i]^2` for `i < len`, accumulated in f64 (global-norm clipping: the caller
    /// sums this over parameters, all-reduced if distributed). Waits for queued work.
    fn sum_squares(&self, x: &Self::Buf, len: usize) -> Result<f64> {
        need("sum_squares", "x", self.len(x), len)?;
        self.run_sum_squares(x, len)
    }
    /// One Adam/AdamW update of the first `len` elements (formula on [`AdamStep`]).
    fn adam_step(
        &self,
        param: &mut Self::Buf,
        grad: &Self::Buf,
        m: &mut Self::Buf,
        v: &mut Self::Buf,
        len: usize,
        step: &AdamStep,
    ) -> Result<()> {
        for (what, have) in [
            ("param", self.len(param)),
            ("grad", self.len(grad)),
            ("m", self.len(m)),
            ("v", self.len(v)),
        ] {
            need("adam_step", what, have, len)?;
        }
        if step.step == 0 {
            return Err(shape_err("adam_step", "step counter must start at 1"));
        }
        if len == 0 {
            return Ok(());
        }
        self.run_adam_step(param, grad, m, v, len, step)
    }
}

impl<K: Kernels + ?Sized> Backend for K {}

/// `at + len`, or a shape error when it overflows (an offset past the address space).
fn end(op: &'static str, at: usize, len: usize) -> Result<usize> {
    at.checked_add(len).ok_or_else(|| {
        shape_err(
            op,
            format!("offset {at} + {len} overflows the address space"),
        )
    })
}

/// Checks that every row an index names (its largest, `max`) lies inside a buffer of `have`
/// elements with `cols` columns.
fn rows_inside(
    op: &'static str,
    what: &str,
    max: Option<u32>,
    cols: usize,
    have: usize,
) -> Result<()> {
    match max {
        Some(m) if (m as usize + 1).checked_mul(cols).is_none_or(|e| e > have) => Err(shape_err(
            op,
            format!("row {m} is outside {what} ({have} elements)"),
        )),
        _ => Ok(()),
    }
}

/// A drop probability must lie in `[0, 1)` (`1` would divide by zero).
fn drop_probability(op: &'static str, p: f32) -> Result<()> {
    if (0.0..1.0).contains(&p) {
        Ok(())
    } else {
        Err(shape_err(op, format!("p must be in [0, 1), got {p}")))
    }
}

/// The gradients an attention backward overwrites: `(grad_x, grad_scores, scratch)`.
type AttentionGrads<'a, B> = (
    &'a <B as Kernels>::Buf,
    &'a <B as Kernels>::Buf,
    &'a <B as Kernels>::Buf,
);

/// Checks the arguments of [`Backend::attention_aggregate`] (`out` is its output) and, with
/// `grads`, of [`Backend::attention_aggregate_backward`] (`out` is then `grad_out`), against
/// the block `graph`: checked once, before the kernels run.
#[allow(clippy::too_many_arguments)]
fn check_attention<B: Kernels + ?Sized>(
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
    let h = att.heads;
    need(op, "x", b.len(x), elems(op, n_src, att.in_cols())?)?;
    need(op, "scores", b.len(scores), elems(op, n_src, 2 * h)?)?;
    need(op, "lse", b.len(lse), elems(op, n_dst, h)?)?;
    let out_name = if grads.is_some() { "grad_out" } else { "out" };
    need(op, out_name, b.len(out), elems(op, n_dst, att.out_cols())?)?;
    if let Some((grad_x, grad_scores, scratch)) = grads {
        need(
            op,
            "grad_x",
            b.len(grad_x),
            elems(op, n_src, att.in_cols())?,
        )?;
        need(
            op,
            "grad_scores",
            b.len(grad_scores),
            elems(op, n_src, 2 * h)?,
        )?;
        need(op, "scratch", b.len(scratch), elems(op, n_dst, h)?)?;
    }
    if let Some(d) = &att.dropout {
        drop_probability(op, d.p)?;
        need(op, "global_ids", b.index_len(d.global_ids), n_src)?;
    }
    Ok(())
}
