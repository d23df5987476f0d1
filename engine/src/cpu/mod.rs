//! The reference CPU backend: rayon over rows, `matrixmultiply` for GEMM, hand-written CSR
//! aggregation kernels.
//!
//! Reductions (column sums, loss, squared norms, LayerNorm parameter gradients, and GEMMs
//! with a long inner dimension) are split into chunks of a FIXED size and the partial results
//! are added in chunk order, so results are bit-identical whatever the thread count.
//!
//! Layout: this file holds [`CpuBackend`] (thread pool, timers) and its [`Kernels`] impl,
//! which times each call (arguments arrive checked by [`crate::Backend`]); the kernels live in `aggregate` (CSR
//! aggregation), `gemm` (dense products), `elementwise` (ReLU, dropout, LayerNorm, loss,
//! Adam) and `simd` (run-time instruction-set detection).

mod aggregate;
mod attention;
mod elementwise;
mod gemm;
mod simd;

pub use aggregate::CpuGraph;

use crate::args::{AdamStep, Attention, DropoutKey};
use crate::block::{BlockGraph, ScaledCsr};
use crate::error::{EngineError, Result};
use crate::host::HostBuffer;
use crate::kernels::{GemmShape, Kernels};
use crate::profile::{aggregate_bytes, OpClass, OpProfile, OpTimes};
use rayon::prelude::*;
use simd::simd_level;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Instant;

/// Rows per parallel task in row-wise kernels.
const ROW_CHUNK: usize = 256;
/// Rows per partial sum in deterministic reductions.
const RED_CHUNK: usize = 4096;
/// Elements per task in element-wise kernels.
const ELEM_CHUNK: usize = 1 << 15;

#[derive(Default)]
struct Timers {
    agg_ns: AtomicU64,
    gemm_ns: AtomicU64,
    other_ns: AtomicU64,
    agg_bytes: AtomicU64,
    /// Nanoseconds per operation name for everything that is neither GEMM nor aggregation.
    by_op: std::sync::Mutex<std::collections::BTreeMap<&'static str, u64>>,
}

/// CPU backend with its own rayon pool (so `--threads` does not touch the global pool).
pub struct CpuBackend {
    pool: std::sync::Arc<rayon::ThreadPool>,
    timers: Timers,
}

/// Makes glibc keep freed memory for reuse instead of unmapping it (process-wide, once).
///
/// Every training step allocates and frees tensors of tens of MB; by default glibc serves
/// those with fresh `mmap`s, so each step pays a page fault and a kernel zeroing for every
/// 4 KiB touched (a measurable share of an epoch). Serving them from the heap without
/// trimming recycles the same pages. Peak memory is unchanged: what is kept is what the
/// previous step already used.
///
/// Ranks run on threads, and a thread's allocations come from one of glibc's thread arenas,
/// made of 64 MiB heaps. glibc deletes such a heap as soon as it is wholly free, whatever the
/// trim threshold (`heap_trim` checks only the top pad), so a step's large buffers kept
/// creating and deleting heaps, and every step faulted its pages in afresh: a 200k-vertex
/// 2 x 2 FLX epoch took 108,000 faults (~0.4 GB zeroed by the kernel). A top pad of a whole
/// heap keeps the heaps: 3,300 faults an epoch, system time about halved, those epochs 20-30 %
/// faster.
/// The pad costs address space, not memory: pages are resident only once touched.
pub fn retain_freed_memory() {
    #[cfg(all(target_os = "linux", target_env = "gnu"))]
    {
        static ONCE: std::sync::Once = std::sync::Once::new();
        ONCE.call_once(|| {
            extern "C" {
                fn mallopt(param: i32, value: i32) -> i32;
            }
            const M_TRIM_THRESHOLD: i32 = -1;
            const M_TOP_PAD: i32 = -2;
            const M_MMAP_MAX: i32 = -4;
            /// glibc's largest thread-arena heap on 64-bit targets (`HEAP_MAX_SIZE`).
            const THREAD_HEAP_BYTES: i32 = 64 << 20;
            // SAFETY: mallopt only changes allocator tuning parameters; it is safe to call at
            // any time from any thread.
            unsafe {
                mallopt(M_MMAP_MAX, 0);
                mallopt(M_TRIM_THRESHOLD, i32::MAX);
                mallopt(M_TOP_PAD, THREAD_HEAP_BYTES);
            }
        });
    }
}

/// Gives the pages of freed memory back to the system, in every glibc arena: for a process
/// that outlives its training runs (a daemon between jobs), which [`retain_freed_memory`]
/// would otherwise leave holding its last run's peak (an idle daemon after a 200k-vertex job
/// kept 1.2 GB). No effect on other C libraries.
pub fn release_freed_memory() {
    #[cfg(all(target_os = "linux", target_env = "gnu"))]
    {
        extern "C" {
            fn malloc_trim(pad: usize) -> i32;
        }
        // SAFETY: malloc_trim only returns free pages to the system; it is safe to call at
        // any time from any thread.
        unsafe {
            malloc_trim(0);
        }
    }
}

impl CpuBackend {
    /// `threads = None` uses rayon's default (one per core). Calls [`retain_freed_memory`].
    pub fn new(threads: Option<usize>) -> Result<CpuBackend> {
        retain_freed_memory();
        let mut builder = rayon::ThreadPoolBuilder::new();
        if let Some(t) = threads {
            builder = builder.num_threads(t.max(1));
        }
        let pool = builder.build().map_err(|e| EngineError::Device {
            backend: "cpu",
            message: format!("cannot start thread pool: {e}"),
        })?;
        Ok(CpuBackend {
            pool: std::sync::Arc::new(pool),
            timers: Timers::default(),
        })
    }

    pub fn threads(&self) -> usize {
        self.pool.current_num_threads()
    }

    /// Runs `f(self)` on one of this backend's own threads. Every operation `f` then calls
    /// runs in place instead of being handed to the pool and waited for.
    pub fn run_within<R: Send>(self, f: impl FnOnce(CpuBackend) -> R + Send) -> R {
        let pool = self.pool.clone();
        pool.install(move || f(self))
    }

    /// Runs `f` inside this backend's pool (callers may use it for their own parallel loops).
    pub fn install<R: Send>(&self, f: impl FnOnce() -> R + Send) -> R {
        self.pool.install(f)
    }

    /// `out = csr * x` over `rows` output rows of width `d`, timed and its bytes counted as
    /// an aggregation.
    fn aggregate_over(
        &self,
        csr: &aggregate::Csr,
        rows: usize,
        x: &[f32],
        d: usize,
        out: &mut [f32],
    ) {
        self.timed(OpClass::Aggregate, || csr.run(x, d, out));
        let bytes = aggregate_bytes(csr.indices.len(), rows, d);
        self.timers.agg_bytes.fetch_add(bytes, Ordering::Relaxed);
    }

    fn timed<R: Send>(&self, kind: OpClass, f: impl FnOnce() -> R + Send) -> R {
        let start = Instant::now();
        let r = self.pool.install(f);
        let ns = start.elapsed().as_nanos() as u64;
        let counter = match kind {
            OpClass::Aggregate => &self.timers.agg_ns,
            OpClass::Gemm => &self.timers.gemm_ns,
            OpClass::Other(name) => {
                if let Ok(mut m) = self.timers.by_op.lock() {
                    *m.entry(name).or_default() += ns;
                }
                &self.timers.other_ns
            }
        };
        counter.fetch_add(ns, Ordering::Relaxed);
        r
    }
}

impl OpProfile for CpuBackend {
    /// Always on: wall-clock timers cost nothing next to a CPU operation.
    fn set_op_timing(&self, _on: bool) {}

    fn op_times(&self) -> OpTimes {
        let t = &self.timers;
        OpTimes {
            aggregate_s: t.agg_ns.load(Ordering::Relaxed) as f64 * 1e-9,
            gemm_s: t.gemm_ns.load(Ordering::Relaxed) as f64 * 1e-9,
            other_s: t.other_ns.load(Ordering::Relaxed) as f64 * 1e-9,
            aggregate_bytes: t.agg_bytes.load(Ordering::Relaxed),
        }
    }

    fn other_op_times(&self) -> Vec<(&'static str, f64)> {
        let mut v: Vec<(&'static str, f64)> = match self.timers.by_op.lock() {
            Ok(m) => m.iter().map(|(&k, &ns)| (k, ns as f64 * 1e-9)).collect(),
            Err(_) => Vec::new(),
        };
        v.sort_by(|a, b| b.1.total_cmp(&a.1));
        v
    }

    fn reset_op_times(&self) {
        if let Ok(mut m) = self.timers.by_op.lock() {
            m.clear();
        }
        let t = &self.timers;
        for c in [&t.agg_ns, &t.gemm_ns, &t.other_ns, &t.agg_bytes] {
            c.store(0, Ordering::Relaxed);
        }
    }
}

/// Sums `f(chunk_index)` over `n_chunks` in parallel and combines the partial vectors in
/// chunk order (deterministic for any thread count).
fn ordered_partials(
    n_chunks: usize,
    width: usize,
    f: impl Fn(usize, &mut [f64]) + Sync,
) -> Vec<f64> {
    let partials: Vec<Vec<f64>> = (0..n_chunks)
        .into_par_iter()
        .map(|c| {
            let mut p = vec![0.0f64; width];
            f(c, &mut p);
            p
        })
        .collect();
    let mut total = vec![0.0f64; width];
    for p in partials {
        for (t, v) in total.iter_mut().zip(p) {
            *t += v;
        }
    }
    total
}

impl Kernels for CpuBackend {
    type Buf = Vec<f32>;
    type Index = Vec<u32>;
    type Graph = CpuGraph;

    fn name(&self) -> String {
        format!("cpu({} threads)", self.threads())
    }

    fn alloc(&self, len: usize) -> Result<Vec<f32>> {
        Ok(vec![0.0; len])
    }

    fn len(&self, buf: &Vec<f32>) -> usize {
        buf.len()
    }

    fn upload(&self, host: &[f32]) -> Result<Vec<f32>> {
        Ok(host.to_vec())
    }

    fn upload_host(&self, host: HostBuffer) -> Result<(Vec<f32>, HostBuffer)> {
        match host.into_vec() {
            Ok(data) => Ok((data, HostBuffer::default())),
            Err(host) => Ok((host.as_slice().to_vec(), host)),
        }
    }

    fn upload_index(&self, host: &[u32]) -> Result<Vec<u32>> {
        Ok(host.to_vec())
    }

    fn index_len(&self, idx: &Vec<u32>) -> usize {
        idx.len()
    }

    fn index_max(&self, idx: &Vec<u32>) -> Option<u32> {
        idx.iter().copied().max()
    }

    fn synchronize(&self) -> Result<()> {
        Ok(())
    }

    fn upload_block(&self, g: &BlockGraph, transpose: &ScaledCsr) -> Result<CpuGraph> {
        Ok(aggregate::upload_block(g, transpose))
    }

    fn graph_dims(&self, g: &CpuGraph) -> (usize, usize, usize) {
        (g.n_dst, g.n_src, g.fwd.indices.len())
    }

    fn run_upload_into(&self, buf: &mut Vec<f32>, offset: usize, host: &[f32]) -> Result<()> {
        buf[offset..offset + host.len()].copy_from_slice(host);
        Ok(())
    }

    fn run_download(&self, buf: &Vec<f32>, offset: usize, out: &mut [f32]) -> Result<()> {
        out.copy_from_slice(&buf[offset..offset + out.len()]);
        Ok(())
    }

    fn run_fill(&self, buf: &mut Vec<f32>, len: usize, value: f32) -> Result<()> {
        self.timed(OpClass::Other("fill"), || {
            buf[..len]
                .par_chunks_mut(ELEM_CHUNK)
                .for_each(|c| c.fill(value))
        });
        Ok(())
    }

    fn run_copy_range(
        &self,
        src: &Vec<f32>,
        src_at: usize,
        dst: &mut Vec<f32>,
        dst_at: usize,
        len: usize,
    ) -> Result<()> {
        self.timed(OpClass::Other("copy"), || {
            dst[dst_at..dst_at + len]
                .par_chunks_mut(ELEM_CHUNK)
                .zip(src[src_at..src_at + len].par_chunks(ELEM_CHUNK))
                .for_each(|(d, s)| d.copy_from_slice(s))
        });
        Ok(())
    }

    fn run_gather_rows(
        &self,
        src: &Vec<f32>,
        cols: usize,
        idx: &Vec<u32>,
        out: &mut Vec<f32>,
    ) -> Result<()> {
        self.timed(OpClass::Other("gather_rows"), || {
            out[..idx.len() * cols]
                .par_chunks_mut(cols)
                .zip(idx.par_iter())
                .for_each(|(o, &r)| {
                    o.copy_from_slice(&src[r as usize * cols..(r as usize + 1) * cols])
                })
        });
        Ok(())
    }

    fn run_scatter_add_rows(
        &self,
        src: &Vec<f32>,
        cols: usize,
        idx: &Vec<u32>,
        out: &mut Vec<f32>,
    ) -> Result<()> {
        // Sequential on purpose: repeated ids must add up in a fixed order, and this runs on
        // halo rows only.
        self.timed(OpClass::Other("scatter_add_rows"), || {
            for (i, &r) in idx.iter().enumerate() {
                let o = &mut out[r as usize * cols..(r as usize + 1) * cols];
                for (a, &b) in o.iter_mut().zip(&src[i * cols..(i + 1) * cols]) {
                    *a += b;
                }
            }
        });
        Ok(())
    }

    fn run_gemm(
        &self,
        shape: GemmShape,
        a: &Vec<f32>,
        b: &Vec<f32>,
        c: &mut Vec<f32>,
    ) -> Result<()> {
        self.timed(OpClass::Gemm, || gemm::gemm(shape, a, b, c));
        Ok(())
    }

    fn run_add_bias(
        &self,
        x: &mut Vec<f32>,
        bias: &Vec<f32>,
        rows: usize,
        cols: usize,
    ) -> Result<()> {
        self.timed(OpClass::Other("add_bias"), || {
            x[..rows * cols].par_chunks_mut(cols).for_each(|r| {
                for (a, &b) in r.iter_mut().zip(&bias[..cols]) {
                    *a += b;
                }
            })
        });
        Ok(())
    }

    fn run_col_sum(
        &self,
        x: &Vec<f32>,
        rows: usize,
        cols: usize,
        beta: f32,
        out: &mut Vec<f32>,
    ) -> Result<()> {
        self.timed(OpClass::Other("col_sum"), || {
            let sums = ordered_partials(rows.div_ceil(RED_CHUNK), cols, |ch, p| {
                let r0 = ch * RED_CHUNK;
                let r1 = (r0 + RED_CHUNK).min(rows);
                for r in r0..r1 {
                    for (acc, &v) in p.iter_mut().zip(&x[r * cols..(r + 1) * cols]) {
                        *acc += v as f64;
                    }
                }
            });
            for (o, s) in out[..cols].iter_mut().zip(sums) {
                *o = if beta == 0.0 {
                    s as f32
                } else {
                    beta * *o + s as f32
                };
            }
        });
        Ok(())
    }

    fn run_aggregate(
        &self,
        g: &CpuGraph,
        x: &Vec<f32>,
        d: usize,
        out: &mut Vec<f32>,
    ) -> Result<()> {
        self.aggregate_over(&g.fwd, g.n_dst, x, d, out);
        Ok(())
    }

    fn run_aggregate_backward(
        &self,
        g: &CpuGraph,
        grad_out: &Vec<f32>,
        d: usize,
        grad_x: &mut Vec<f32>,
    ) -> Result<()> {
        // The backward pass is the forward one over the transposed graph.
        self.aggregate_over(&g.bwd, g.n_src, grad_out, d, grad_x);
        Ok(())
    }

    fn run_attention_aggregate(
        &self,
        g: &CpuGraph,
        x: &Vec<f32>,
        scores: &Vec<f32>,
        att: &Attention<'_, Vec<u32>>,
        out: &mut Vec<f32>,
        lse: &mut Vec<f32>,
    ) -> Result<()> {
        let call = attn_call(att);
        self.timed(OpClass::Aggregate, || {
            attention::forward(g, &call, x, scores, out, lse)
        });
        Ok(())
    }

    fn run_attention_aggregate_backward(
        &self,
        g: &CpuGraph,
        x: &Vec<f32>,
        scores: &Vec<f32>,
        lse: &Vec<f32>,
        att: &Attention<'_, Vec<u32>>,
        grad_out: &Vec<f32>,
        grad_x: &mut Vec<f32>,
        grad_scores: &mut Vec<f32>,
        scratch: &mut Vec<f32>,
    ) -> Result<()> {
        let call = attn_call(att);
        self.timed(OpClass::Aggregate, || {
            attention::backward(
                g,
                &call,
                x,
                scores,
                lse,
                grad_out,
                grad_x,
                grad_scores,
                scratch,
            )
        });
        Ok(())
    }

    fn run_relu(&self, x: &Vec<f32>, out: &mut Vec<f32>, len: usize) -> Result<()> {
        self.timed(OpClass::Other("relu"), || elementwise::relu(x, out, len));
        Ok(())
    }

    fn run_bias_relu(
        &self,
        y: &Vec<f32>,
        bias: &Vec<f32>,
        out: &mut Vec<f32>,
        rows: usize,
        cols: usize,
    ) -> Result<()> {
        self.timed(OpClass::Other("bias_relu"), || {
            out[..rows * cols]
                .par_chunks_mut(cols)
                .zip(y[..rows * cols].par_chunks(cols))
                .for_each(|(o, y)| {
                    for ((o, &y), &b) in o.iter_mut().zip(y).zip(&bias[..cols]) {
                        *o = (y + b).max(0.0);
                    }
                })
        });
        Ok(())
    }

    fn run_relu_backward(&self, y: &Vec<f32>, grad: &mut Vec<f32>, len: usize) -> Result<()> {
        self.timed(OpClass::Other("relu_backward"), || {
            elementwise::relu_backward(y, grad, len)
        });
        Ok(())
    }

    fn run_dropout(
        &self,
        x: &Vec<f32>,
        out: &mut Vec<f32>,
        rows: usize,
        cols: usize,
        global_ids: &Vec<u32>,
        p: f32,
        key: DropoutKey,
    ) -> Result<()> {
        let (stream, thr, scale) = key.mask_constants(p);
        let level = simd_level();
        self.timed(OpClass::Other("dropout"), || {
            elementwise::dropout(x, out, rows, cols, global_ids, stream, thr, scale, level)
        });
        Ok(())
    }

    fn run_dropout_backward(
        &self,
        grad: &mut Vec<f32>,
        rows: usize,
        cols: usize,
        global_ids: &Vec<u32>,
        p: f32,
        key: DropoutKey,
    ) -> Result<()> {
        let (stream, thr, scale) = key.mask_constants(p);
        let level = simd_level();
        self.timed(OpClass::Other("dropout_backward"), || {
            elementwise::dropout_backward(grad, rows, cols, global_ids, stream, thr, scale, level)
        });
        Ok(())
    }

    fn run_axpy(&self, alpha: f32, x: &Vec<f32>, y: &mut Vec<f32>, len: usize) -> Result<()> {
        self.timed(OpClass::Other("axpy"), || {
            y[..len]
                .par_chunks_mut(ELEM_CHUNK)
                .zip(x[..len].par_chunks(ELEM_CHUNK))
                .for_each(|(y, x)| {
                    for (a, &b) in y.iter_mut().zip(x) {
                        *a += alpha * b;
                    }
                })
        });
        Ok(())
    }

    fn run_scale(&self, x: &mut Vec<f32>, alpha: f32, len: usize) -> Result<()> {
        self.timed(OpClass::Other("scale"), || {
            x[..len]
                .par_chunks_mut(ELEM_CHUNK)
                .for_each(|c| c.iter_mut().for_each(|a| *a *= alpha))
        });
        Ok(())
    }

    fn run_layer_norm(
        &self,
        x: &Vec<f32>,
        gamma: &Vec<f32>,
        beta: &Vec<f32>,
        rows: usize,
        cols: usize,
        eps: f32,
        out: &mut Vec<f32>,
        mean: &mut Vec<f32>,
        rstd: &mut Vec<f32>,
    ) -> Result<()> {
        self.timed(OpClass::Other("layer_norm"), || {
            elementwise::layer_norm(x, gamma, beta, rows, cols, eps, out, mean, rstd)
        });
        Ok(())
    }

    fn run_layer_norm_backward(
        &self,
        grad_out: &Vec<f32>,
        x: &Vec<f32>,
        gamma: &Vec<f32>,
        mean: &Vec<f32>,
        rstd: &Vec<f32>,
        rows: usize,
        cols: usize,
        grad_x: &mut Vec<f32>,
        grad_gamma: &mut Vec<f32>,
        grad_beta: &mut Vec<f32>,
    ) -> Result<()> {
        self.timed(OpClass::Other("layer_norm_backward"), || {
            elementwise::layer_norm_backward(
                grad_out, x, gamma, mean, rstd, rows, cols, grad_x, grad_gamma, grad_beta,
            )
        });
        Ok(())
    }

    fn run_cross_entropy(
        &self,
        logits: &Vec<f32>,
        n: usize,
        classes: usize,
        rows: &Vec<u32>,
        labels: &Vec<u32>,
        normalizer: f32,
        grad: &mut Vec<f32>,
    ) -> Result<f64> {
        Ok(self.timed(OpClass::Other("cross_entropy"), || {
            elementwise::cross_entropy(logits, n, classes, rows, labels, normalizer, grad)
        }))
    }

    fn run_sum_squares(&self, x: &Vec<f32>, len: usize) -> Result<f64> {
        Ok(self.timed(OpClass::Other("sum_squares"), || {
            ordered_partials(len.div_ceil(ELEM_CHUNK), 1, |ch, p| {
                let s = ch * ELEM_CHUNK;
                let e = (s + ELEM_CHUNK).min(len);
                p[0] = x[s..e].iter().map(|&v| (v as f64) * (v as f64)).sum();
            })[0]
        }))
    }

    fn run_adam_step(
        &self,
        param: &mut Vec<f32>,
        grad: &Vec<f32>,
        m: &mut Vec<f32>,
        v: &mut Vec<f32>,
        len: usize,
        s: &AdamStep,
    ) -> Result<()> {
        let (bc1, bc2) = s.bias_corrections();
        let s = *s;
        self.timed(OpClass::Other("adam_step"), || {
            elementwise::adam_step(param, grad, m, v, len, &s, bc1, bc2)
        });
        Ok(())
    }
}

/// The host-side constants of an attention call.
fn attn_call<'a>(att: &Attention<'a, Vec<u32>>) -> attention::AttnCall<'a> {
    attention::AttnCall {
        heads: att.heads,
        head_dim: att.head_dim,
        concat: att.concat,
        slope: att.negative_slope,
        self_loops: att.self_loops,
        drop: att.dropout.as_ref().map(|d| {
            let (stream, thr, scale) = d.mask_constants();
            (d.global_ids.as_slice(), stream, thr, scale)
        }),
    }
}
