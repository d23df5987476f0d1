//! The [`Kernels`] trait: what a backend implements. Each `run_*` method carries out one
//! operation of [`crate::Backend`] on arguments that [`crate::Backend`] has already checked
//! (buffers long enough, ids in range, probabilities and step counters valid, sizes that do not
//! overflow, work to do), so an implementation holds only its launches and loops; checks that
//! depend on the device itself (cuBLAS's 32-bit dimensions, launch limits) stay with it.
//!
//! Nothing outside the engine's backends calls a `run_*` method: models and runtimes call
//! [`crate::Backend`], which every `Kernels` type is, by a blanket implementation.

use crate::block::{BlockGraph, ScaledCsr};
use crate::error::Result;
use crate::host::HostBuffer;

/// The shape and scalars of one GEMM, `C[m x n] = alpha * op(A) * op(B) + beta * C`
/// ([`crate::Backend::gemm`] documents them): what [`crate::Backend::gemm`] hands its backend
/// once the buffers are checked against it.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct GemmShape {
    /// `A` is stored `k x m` (op(A) = A^T).
    pub trans_a: bool,
    /// `B` is stored `n x k` (op(B) = B^T).
    pub trans_b: bool,
    pub m: usize,
    pub n: usize,
    pub k: usize,
    pub alpha: f32,
    /// With `beta == 0` the old contents of `C` are ignored (even NaN).
    pub beta: f32,
}

/// The methods of [`Kernels`] that every implementation has in the same form, listed once and
/// handed to the macro named `$m`: the trait declares them from this list, the build without
/// CUDA implements them (none can be called), and a wrapper backend (parallel's `Metered`)
/// forwards them. Adding a kernel is one entry here and its body in each real backend.
#[macro_export]
#[doc(hidden)]
macro_rules! kernel_list {
    ($m:ident) => {
        $m! {
            /// Number of `f32` elements in `buf`.
            fn len(&self, buf: &Self::Buf) -> usize;
            /// Number of entries in an index buffer.
            fn index_len(&self, idx: &Self::Index) -> usize;
            /// The largest entry of an index buffer (`None` when empty), for range checks: a
            /// backend that keeps the host copy's maximum from the upload answers without a
            /// pass.
            fn index_max(&self, idx: &Self::Index) -> Option<u32>;
            /// Waits until all queued work is done (for timing).
            fn synchronize(&self) -> $crate::Result<()>;
            /// `(n_dst, n_src, num_edges)` of an uploaded graph.
            fn graph_dims(&self, graph: &Self::Graph) -> (usize, usize, usize);

            // ---- the operations, arguments checked ----------------------------------------------


            fn run_upload_into(
                &self,
                buf: &mut Self::Buf,
                offset: usize,
                host: &[f32],
            ) -> $crate::Result<()>;
            fn run_download(
                &self,
                buf: &Self::Buf,
                offset: usize,
                out: &mut [f32],
            ) -> $crate::Result<()>;
            fn run_fill(&self, buf: &mut Self::Buf, len: usize, value: f32) -> $crate::Result<()>;
            fn run_copy_range(
                &self,
                src: &Self::Buf,
                src_at: usize,
                dst: &mut Self::Buf,
                dst_at: usize,
                len: usize,
            ) -> $crate::Result<()>;
            fn run_gather_rows(
                &self,
                src: &Self::Buf,
                cols: usize,
                idx: &Self::Index,
                out: &mut Self::Buf,
            ) -> $crate::Result<()>;
            fn run_scatter_add_rows(
                &self,
                src: &Self::Buf,
                cols: usize,
                idx: &Self::Index,
                out: &mut Self::Buf,
            ) -> $crate::Result<()>;
            fn run_gemm(
                &self,
                shape: $crate::GemmShape,
                a: &Self::Buf,
                b: &Self::Buf,
                c: &mut Self::Buf,
            ) -> $crate::Result<()>;
            fn run_add_bias(
                &self,
                x: &mut Self::Buf,
                bias: &Self::Buf,
                rows: usize,
                cols: usize,
            ) -> $crate::Result<()>;
            fn run_col_sum(
                &self,
                x: &Self::Buf,
                rows: usize,
                cols: usize,
                beta: f32,
                out: &mut Self::Buf,
            ) -> $crate::Result<()>;
            fn run_aggregate(
                &self,
                graph: &Self::Graph,
                x: &Self::Buf,
                d: usize,
                out: &mut Self::Buf,
            ) -> $crate::Result<()>;
            fn run_aggregate_backward(
                &self,
                graph: &Self::Graph,
                grad_out: &Self::Buf,
                d: usize,
                grad_x: &mut Self::Buf,
            ) -> $crate::Result<()>;
            fn run_relu(
                &self,
                x: &Self::Buf,
                out: &mut Self::Buf,
                len: usize,
            ) -> $crate::Result<()>;
            fn run_bias_relu(
                &self,
                y: &Self::Buf,
                bias: &Self::Buf,
                out: &mut Self::Buf,
                rows: usize,
                cols: usize,
            ) -> $crate::Result<()>;
            fn run_relu_backward(
                &self,
                y: &Self::Buf,
                grad: &mut Self::Buf,
                len: usize,
            ) -> $crate::Result<()>;
            #[allow(clippy::too_many_arguments)]
            fn run_dropout(
                &self,
                x: &Self::Buf,
                out: &mut Self::Buf,
                rows: usize,
                cols: usize,
                global_ids: &Self::Index,
                p: f32,
                key: $crate::DropoutKey,
            ) -> $crate::Result<()>;
            fn run_dropout_backward(
                &self,
                grad: &mut Self::Buf,
                rows: usize,
                cols: usize,
                global_ids: &Self::Index,
                p: f32,
                key: $crate::DropoutKey,
            ) -> $crate::Result<()>;
            fn run_axpy(
                &self,
                alpha: f32,
                x: &Self::Buf,
                y: &mut Self::Buf,
                len: usize,
            ) -> $crate::Result<()>;
            fn run_scale(&self, x: &mut Self::Buf, alpha: f32, len: usize) -> $crate::Result<()>;
            #[allow(clippy::too_many_arguments)]
            fn run_layer_norm(
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
            ) -> $crate::Result<()>;
            #[allow(clippy::too_many_arguments)]
            fn run_layer_norm_backward(
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
            ) -> $crate::Result<()>;
            #[allow(clippy::too_many_arguments)]
            fn run_cross_entropy(
                &self,
                logits: &Self::Buf,
                n: usize,
                classes: usize,
                rows: &Self::Index,
                labels: &Self::Index,
                normalizer: f32,
                grad: &mut Self::Buf,
            ) -> $crate::Result<f64>;
            fn run_sum_squares(&self, x: &Self::Buf, len: usize) -> $crate::Result<f64>;
            fn run_adam_step(
                &self,
                param: &mut Self::Buf,
                grad: &Self::Buf,
                m: &mut Self::Buf,
                v: &mut Self::Buf,
                len: usize,
                step: &$crate::AdamStep,
            ) -> $crate::Result<()>;
            #[allow(clippy::too_many_arguments)]
            fn run_attention_aggregate(
                &self,
                graph: &Self::Graph,
                x: &Self::Buf,
                scores: &Self::Buf,
                att: &$crate::Attention<'_, Self::Index>,
                out: &mut Self::Buf,
                lse: &mut Self::Buf,
            ) -> $crate::Result<()>;
            #[allow(clippy::too_many_arguments)]
            fn run_attention_aggregate_backward(
                &self,
                graph: &Self::Graph,
                x: &Self::Buf,
                scores: &Self::Buf,
                lse: &Self::Buf,
                att: &$crate::Attention<'_, Self::Index>,
                grad_out: &Self::Buf,
                grad_x: &mut Self::Buf,
                grad_scores: &mut Self::Buf,
                scratch: &mut Self::Buf,
            ) -> $crate::Result<()>;
        }
    };
}

/// Declares the listed methods (their documentation is on [`crate::Backend`]'s methods of
/// the same name without `run_`).
macro_rules! declare {
    ($($(#[$a:meta])* fn $name:ident(&self $(, $arg:ident: $ty:ty)* $(,)?) -> $ret:ty;)*) => {
        $($(#[$a])* fn $name(&self $(, $arg: $ty)*) -> $ret;)*
    };
}

/// A compute backend's buffers and kernels. All methods take `&self`: a backend is shared by
/// the layers of a model, and implementations use interior synchronisation where they need it.
///
/// The documentation of each operation (what it computes, what it overwrites or accumulates)
/// is on the [`crate::Backend`] method of the same name without `run_`.
pub trait Kernels: Send + Sync {
    /// A dense `f32` buffer.
    type Buf: Send + Sync;
    /// A `u32` buffer (row ids, global vertex ids, labels).
    type Index: Send + Sync;
    /// An uploaded [`BlockGraph`] together with its transpose (built once, on the host, for
    /// the backward pass) and whatever per-edge data the backend precomputes.
    type Graph: Send + Sync;

    /// Short name for logs ("cpu", "cuda:0").
    fn name(&self) -> String;

    // ---- buffers: allocation and sizes (nothing to check) -------------------------------

    /// A zero-filled buffer of `len` elements.
    fn alloc(&self, len: usize) -> Result<Self::Buf>;
    /// A new buffer holding a copy of `host`.
    fn upload(&self, host: &[f32]) -> Result<Self::Buf>;
    /// A new buffer holding `host`'s data, which the caller no longer needs: a backend whose
    /// buffers are host memory keeps plain memory without a copy (and hands back an empty
    /// buffer), the others copy it (at full speed from page-locked memory) and hand it back
    /// for reuse.
    fn upload_host(&self, host: HostBuffer) -> Result<(Self::Buf, HostBuffer)> {
        Ok((self.upload(host.as_slice())?, host))
    }
    /// A new index buffer holding a copy of `host`.
    fn upload_index(&self, host: &[u32]) -> Result<Self::Index>;
    /// Uploads a block validated by [`BlockGraph::validate`] with its transpose.
    fn upload_block(&self, graph: &BlockGraph, transpose: &ScaledCsr) -> Result<Self::Graph>;

    kernel_list!(declare);
}
