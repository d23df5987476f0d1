//! The reference CPU backend: rayon over rows, `matrixmultiply` for GEMM, hand-written CSR
//! aggregation kernels.
//!
//! Reductions (column sums, loss, squared norms, LayerNorm parameter gradients, and GEMMs
//! with a long inner dimension) are split into chunks of a FIXED size and the partial results
//! are added in chunk order, so results are bit-identical whatever the thread count.

use crate::backend::{
    dropout_threshold, shape_err, AdamStep, Backend, BlockGraph, DropoutKey, EngineError, Result,
};
use rayon::prelude::*;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Instant;

/// Rows per parallel task in row-wise kernels.
const ROW_CHUNK: usize = 256;
/// Rows per partial sum in deterministic reductions.
const RED_CHUNK: usize = 4096;
/// Elements per task in element-wise kernels.
const ELEM_CHUNK: usize = 1 << 15;

/// Wall time spent per operation class since the last [`CpuBackend::reset_op_times`].
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct OpTimes {
    pub aggregate_s: f64,
    pub gemm_s: f64,
    pub other_s: f64,
    /// Bytes the aggregation kernels gathered (source rows read, with repetition) plus wrote.
    pub aggregate_bytes: u64,
}

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
    pool: rayon::ThreadPool,
    timers: Timers,
}

/// An uploaded graph block: forward CSR and its transpose, with their scale vectors.
pub struct CpuGraph {
    fwd: Csr,
    bwd: Csr,
    n_dst: usize,
    n_src: usize,
}

/// `out[v] = dst[v] * sum_{u in row v} src[u] * x[u] + self_[v] * x[v]`.
struct Csr {
    offsets: Vec<usize>,
    indices: Vec<u32>,
    dst: Vec<f32>,
    src: Option<Vec<f32>>,
    self_: Option<Vec<f32>>,
}

fn need(op: &'static str, what: &str, have: usize, want: usize) -> Result<()> {
    if have < want {
        Err(shape_err(
            op,
            format!("{what} has {have} elements, needs at least {want}"),
        ))
    } else {
        Ok(())
    }
}

enum Kind {
    Agg,
    Gemm,
    Other(&'static str),
}

/// Makes glibc keep freed memory for reuse instead of unmapping it (process-wide, once).
///
/// Every training step allocates and frees tensors of tens of MB; by default glibc serves
/// those with fresh `mmap`s, so each step pays a page fault and a kernel zeroing for every
/// 4 KiB touched (a measurable share of an epoch). Serving them from the heap without
/// trimming recycles the same pages. Peak memory is unchanged: what is kept is what the
/// previous step already used.
pub fn retain_freed_memory() {
    #[cfg(all(target_os = "linux", target_env = "gnu"))]
    {
        static ONCE: std::sync::Once = std::sync::Once::new();
        ONCE.call_once(|| {
            extern "C" {
                fn mallopt(param: i32, value: i32) -> i32;
            }
            const M_TRIM_THRESHOLD: i32 = -1;
            const M_MMAP_MAX: i32 = -4;
            // SAFETY: mallopt only changes allocator tuning parameters; it is safe to call at
            // any time from any thread.
            unsafe {
                mallopt(M_MMAP_MAX, 0);
                mallopt(M_TRIM_THRESHOLD, i32::MAX);
            }
        });
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
            pool,
            timers: Timers::default(),
        })
    }

    pub fn threads(&self) -> usize {
        self.pool.current_num_threads()
    }

    /// Runs `f` inside this backend's pool (callers may use it for their own parallel loops).
    pub fn install<R: Send>(&self, f: impl FnOnce() -> R + Send) -> R {
        self.pool.install(f)
    }

    pub fn op_times(&self) -> OpTimes {
        let t = &self.timers;
        OpTimes {
            aggregate_s: t.agg_ns.load(Ordering::Relaxed) as f64 * 1e-9,
            gemm_s: t.gemm_ns.load(Ordering::Relaxed) as f64 * 1e-9,
            other_s: t.other_ns.load(Ordering::Relaxed) as f64 * 1e-9,
            aggregate_bytes: t.agg_bytes.load(Ordering::Relaxed),
        }
    }

    /// Seconds per operation name (the "other" class broken down), largest first.
    pub fn other_op_times(&self) -> Vec<(&'static str, f64)> {
        let mut v: Vec<(&'static str, f64)> = match self.timers.by_op.lock() {
            Ok(m) => m.iter().map(|(&k, &ns)| (k, ns as f64 * 1e-9)).collect(),
            Err(_) => Vec::new(),
        };
        v.sort_by(|a, b| b.1.total_cmp(&a.1));
        v
    }

    pub fn reset_op_times(&self) {
        if let Ok(mut m) = self.timers.by_op.lock() {
            m.clear();
        }
        let t = &self.timers;
        for c in [&t.agg_ns, &t.gemm_ns, &t.other_ns, &t.agg_bytes] {
            c.store(0, Ordering::Relaxed);
        }
    }

    fn timed<R: Send>(&self, kind: Kind, f: impl FnOnce() -> R + Send) -> R {
        let start = Instant::now();
        let r = self.pool.install(f);
        let ns = start.elapsed().as_nanos() as u64;
        let counter = match kind {
            Kind::Agg => &self.timers.agg_ns,
            Kind::Gemm => &self.timers.gemm_ns,
            Kind::Other(name) => {
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

impl Csr {
    /// The kernel shared by forward (A) and backward (A^T): parallel over output rows. Each
    /// row is computed in column blocks whose accumulators live in registers, reading the
    /// neighbour rows in CSR order with software prefetch a few neighbours ahead (the gather
    /// is latency-bound otherwise). The arithmetic order is the same on every instruction set
    /// (no FMA contraction), so results do not depend on the CPU it runs on.
    fn run(&self, x: &[f32], d: usize, out: &mut [f32]) {
        let n_rows = self.offsets.len() - 1;
        let level = simd_level();
        out[..n_rows * d]
            .par_chunks_mut(ROW_CHUNK * d)
            .enumerate()
            .for_each(|(chunk, rows)| {
                let first = chunk * ROW_CHUNK;
                // SAFETY: `simd_level` only reports features the CPU has; `rows_kernel`'s own
                // preconditions (validated graph, x holding n_src * d values) are checked by
                // the callers (`aggregate`, `aggregate_backward`).
                unsafe {
                    match level {
                        Simd::Avx512 => self.rows_avx512(first, rows, x, d),
                        Simd::Avx2 => self.rows_avx2(first, rows, x, d),
                        Simd::Base => self.rows_kernel(first, rows, x, d),
                    }
                }
            });
    }

    #[cfg(target_arch = "x86_64")]
    #[target_feature(enable = "avx512f")]
    unsafe fn rows_avx512(&self, first: usize, rows: &mut [f32], x: &[f32], d: usize) {
        self.rows_kernel(first, rows, x, d)
    }

    #[cfg(target_arch = "x86_64")]
    #[target_feature(enable = "avx2")]
    unsafe fn rows_avx2(&self, first: usize, rows: &mut [f32], x: &[f32], d: usize) {
        self.rows_kernel(first, rows, x, d)
    }

    #[cfg(not(target_arch = "x86_64"))]
    unsafe fn rows_avx512(&self, first: usize, rows: &mut [f32], x: &[f32], d: usize) {
        self.rows_kernel(first, rows, x, d)
    }

    #[cfg(not(target_arch = "x86_64"))]
    unsafe fn rows_avx2(&self, first: usize, rows: &mut [f32], x: &[f32], d: usize) {
        self.rows_kernel(first, rows, x, d)
    }

    /// Computes output rows `first..` into `rows` (a multiple of `d` values).
    ///
    /// # Safety
    /// Every index in the graph is `< x.len() / d` (guaranteed by `BlockGraph::validate` and
    /// the callers' length checks), and for rows with a self term `v < x.len() / d`.
    #[inline(always)]
    unsafe fn rows_kernel(&self, first: usize, rows: &mut [f32], x: &[f32], d: usize) {
        for (i, out) in rows.chunks_exact_mut(d).enumerate() {
            let v = first + i;
            let nbrs = &self.indices[self.offsets[v]..self.offsets[v + 1]];
            let ds = self.dst[v];
            // In A^T, halo rows (v >= n_dst) have no self term and no row in the input:
            // their weight is 0 and the read is skipped.
            let own = match &self.self_ {
                Some(sl) if sl[v] != 0.0 => Some((sl[v], &x[v * d..v * d + d])),
                _ => None,
            };
            let src = self.src.as_deref();
            let mut c0 = 0;
            while c0 < d {
                let left = d - c0;
                if left >= 64 {
                    // A whole 256-byte row segment per neighbour: four cache lines in flight
                    // per gather, accumulators still fit in registers (4 zmm / 8 ymm).
                    block::<64>(nbrs, src, x, d, c0, ds, own, &mut out[c0..c0 + 64]);
                    c0 += 64;
                } else if left >= 32 {
                    block::<32>(nbrs, src, x, d, c0, ds, own, &mut out[c0..c0 + 32]);
                    c0 += 32;
                } else if left >= 16 {
                    block::<16>(nbrs, src, x, d, c0, ds, own, &mut out[c0..c0 + 16]);
                    c0 += 16;
                } else if left >= 8 {
                    block::<8>(nbrs, src, x, d, c0, ds, own, &mut out[c0..c0 + 8]);
                    c0 += 8;
                } else {
                    block::<1>(nbrs, src, x, d, c0, ds, own, &mut out[c0..c0 + 1]);
                    c0 += 1;
                }
            }
        }
    }
}

/// Neighbours to look ahead when prefetching.
const PREFETCH_AHEAD: usize = 8;

/// Columns `c0..c0 + W` of one output row.
///
/// # Safety
/// See [`Csr::rows_kernel`].
#[inline(always)]
#[allow(clippy::too_many_arguments)]
unsafe fn block<const W: usize>(
    nbrs: &[u32],
    src: Option<&[f32]>,
    x: &[f32],
    d: usize,
    c0: usize,
    ds: f32,
    own: Option<(f32, &[f32])>,
    out: &mut [f32],
) {
    let mut acc = [0.0f32; W];
    let xp = x.as_ptr();
    for (i, &u) in nbrs.iter().enumerate() {
        if let Some(&ahead) = nbrs.get(i + PREFETCH_AHEAD) {
            let p = xp.add(ahead as usize * d + c0);
            let mut off = 0;
            while off < W {
                prefetch(p.add(off));
                off += 16;
            }
        }
        // SAFETY: u < n_src and x holds n_src * d values (caller contract).
        let row = &*(xp.add(u as usize * d + c0) as *const [f32; W]);
        match src {
            None => {
                for j in 0..W {
                    acc[j] += row[j];
                }
            }
            Some(s) => {
                let w = *s.get_unchecked(u as usize);
                for j in 0..W {
                    acc[j] += w * row[j];
                }
            }
        }
    }
    match own {
        None => {
            for j in 0..W {
                out[j] = ds * acc[j];
            }
        }
        Some((w, own)) => {
            for j in 0..W {
                out[j] = ds * acc[j] + w * own[c0 + j];
            }
        }
    }
}

#[inline(always)]
fn prefetch(p: *const f32) {
    #[cfg(target_arch = "x86_64")]
    // SAFETY: prefetch is a hint and never faults, whatever the address.
    unsafe {
        std::arch::x86_64::_mm_prefetch(p as *const i8, std::arch::x86_64::_MM_HINT_T0);
    }
    #[cfg(not(target_arch = "x86_64"))]
    let _ = p;
}

/// `a * b + c`, fused where the caller runs with FMA enabled.
#[inline(always)]
fn madd<const FMA: bool>(a: f32, b: f32, c: f32) -> f32 {
    if FMA {
        a.mul_add(b, c)
    } else {
        a * b + c
    }
}

/// Largest `k * n` (elements of B) for the tall-skinny GEMM kernel: B stays in L1/L2.
const SKINNY_MAX_B: usize = 1 << 14;

/// `C = alpha * A B + beta * C` for row-major A (`rows x k`), B (`k x n`), C (`rows x n`),
/// two rows at a time with the output columns in register blocks. Where the CPU has FMA the
/// multiply-adds are fused (half the instructions); results are then deterministic per CPU
/// type, and differ from a CPU without FMA only in rounding.
struct Skinny {
    k: usize,
    n: usize,
    alpha: f32,
    beta: f32,
}

impl Skinny {
    /// # Safety
    /// `level` must only name features this CPU has.
    unsafe fn dispatch(&self, level: Simd, a: &[f32], b: &[f32], c: &mut [f32]) {
        match level {
            #[cfg(target_arch = "x86_64")]
            Simd::Avx512 if std::arch::is_x86_feature_detected!("fma") => self.run_avx512(a, b, c),
            #[cfg(target_arch = "x86_64")]
            Simd::Avx2 if std::arch::is_x86_feature_detected!("fma") => self.run_avx2(a, b, c),
            _ => self.run(a, b, c),
        }
    }

    #[cfg(target_arch = "x86_64")]
    #[target_feature(enable = "avx512f,fma")]
    unsafe fn run_avx512(&self, a: &[f32], b: &[f32], c: &mut [f32]) {
        self.run_with::<true>(a, b, c)
    }

    #[cfg(target_arch = "x86_64")]
    #[target_feature(enable = "avx2,fma")]
    unsafe fn run_avx2(&self, a: &[f32], b: &[f32], c: &mut [f32]) {
        self.run_with::<true>(a, b, c)
    }

    fn run(&self, a: &[f32], b: &[f32], c: &mut [f32]) {
        self.run_with::<false>(a, b, c)
    }

    #[inline(always)]
    fn run_with<const FMA: bool>(&self, a: &[f32], b: &[f32], c: &mut [f32]) {
        let n = self.n;
        let mut j0 = 0;
        while j0 < n {
            let left = n - j0;
            if left >= 64 {
                self.cols::<64, FMA>(a, b, c, j0);
                j0 += 64;
            } else if left >= 32 {
                self.cols::<32, FMA>(a, b, c, j0);
                j0 += 32;
            } else if left >= 16 {
                self.cols::<16, FMA>(a, b, c, j0);
                j0 += 16;
            } else if left >= 8 {
                self.cols::<8, FMA>(a, b, c, j0);
                j0 += 8;
            } else {
                self.cols::<1, FMA>(a, b, c, j0);
                j0 += 1;
            }
        }
    }

    /// Columns `j0..j0 + W` of every row.
    #[inline(always)]
    fn cols<const W: usize, const FMA: bool>(
        &self,
        a: &[f32],
        b: &[f32],
        c: &mut [f32],
        j0: usize,
    ) {
        let (k, n) = (self.k, self.n);
        let rows = c.len() / n;
        // Two rows at a time for the wide blocks (register budget), four for narrow ones.
        const RB: usize = 2;
        let mut r = 0;
        while r + RB <= rows {
            let mut acc = [[0.0f32; W]; RB];
            for p in 0..k {
                let brow: &[f32; W] = b[p * n + j0..p * n + j0 + W].try_into().unwrap();
                for (q, acc) in acc.iter_mut().enumerate() {
                    let av = a[(r + q) * k + p];
                    for j in 0..W {
                        acc[j] = madd::<FMA>(av, brow[j], acc[j]);
                    }
                }
            }
            for (q, acc) in acc.iter().enumerate() {
                self.store(&mut c[(r + q) * n + j0..(r + q) * n + j0 + W], acc);
            }
            r += RB;
        }
        while r < rows {
            let mut acc = [0.0f32; W];
            for p in 0..k {
                let brow: &[f32; W] = b[p * n + j0..p * n + j0 + W].try_into().unwrap();
                let av = a[r * k + p];
                for j in 0..W {
                    acc[j] = madd::<FMA>(av, brow[j], acc[j]);
                }
            }
            self.store(&mut c[r * n + j0..r * n + j0 + W], &acc);
            r += 1;
        }
    }

    #[inline(always)]
    fn store<const W: usize>(&self, c: &mut [f32], acc: &[f32; W]) {
        if self.beta == 0.0 {
            for j in 0..W {
                c[j] = self.alpha * acc[j];
            }
        } else {
            for j in 0..W {
                c[j] = self.alpha * acc[j] + self.beta * c[j];
            }
        }
    }
}

/// The dropout mask of one call, applied to rows in a vectorisable loop (the hash is the one
/// of [`crate::backend::dropout_keep`], evaluated with `stream ^ (gid << 32)` hoisted out of the column loop).
struct Mask {
    stream: u64,
    thr: u32,
    scale: f32,
    cols: usize,
}

impl Mask {
    /// `out = mask(src or out) * scale` for the rows of `ids`.
    ///
    /// # Safety
    /// `level` must only name features this CPU has.
    unsafe fn dispatch(&self, level: Simd, ids: &[u32], src: Option<&[f32]>, out: &mut [f32]) {
        match level {
            #[cfg(target_arch = "x86_64")]
            Simd::Avx512 if std::arch::is_x86_feature_detected!("avx512dq") => {
                self.rows_avx512(ids, src, out)
            }
            #[cfg(target_arch = "x86_64")]
            Simd::Avx512 | Simd::Avx2 => self.rows_avx2(ids, src, out),
            _ => self.rows(ids, src, out),
        }
    }

    #[cfg(target_arch = "x86_64")]
    #[target_feature(enable = "avx512f,avx512dq")]
    unsafe fn rows_avx512(&self, ids: &[u32], src: Option<&[f32]>, out: &mut [f32]) {
        self.rows(ids, src, out)
    }

    #[cfg(target_arch = "x86_64")]
    #[target_feature(enable = "avx2")]
    unsafe fn rows_avx2(&self, ids: &[u32], src: Option<&[f32]>, out: &mut [f32]) {
        self.rows(ids, src, out)
    }

    #[inline(always)]
    fn rows(&self, ids: &[u32], src: Option<&[f32]>, out: &mut [f32]) {
        let c = self.cols;
        for (r, &gid) in ids.iter().enumerate() {
            let base = self.stream ^ ((gid as u64) << 32);
            let o = &mut out[r * c..(r + 1) * c];
            match src {
                Some(src) => {
                    let i = &src[r * c..(r + 1) * c];
                    for j in 0..c {
                        let h = crate::backend::mix64(base ^ j as u64);
                        let keep = (h >> 40) as u32 >= self.thr;
                        o[j] = if keep { i[j] * self.scale } else { 0.0 };
                    }
                }
                None => {
                    for v in o.iter_mut().enumerate() {
                        let (j, v) = v;
                        let h = crate::backend::mix64(base ^ j as u64);
                        let keep = (h >> 40) as u32 >= self.thr;
                        *v = if keep { *v * self.scale } else { 0.0 };
                    }
                }
            }
        }
    }
}

#[derive(Clone, Copy)]
enum Simd {
    Avx512,
    Avx2,
    Base,
}

fn simd_level() -> Simd {
    #[cfg(target_arch = "x86_64")]
    {
        if std::arch::is_x86_feature_detected!("avx512f") {
            return Simd::Avx512;
        }
        if std::arch::is_x86_feature_detected!("avx2") {
            return Simd::Avx2;
        }
    }
    Simd::Base
}

/// One matrixmultiply call on a row range of C. `a` points at the start of A, `rows` are the
/// rows of C (and of op(A)) to compute.
#[allow(clippy::too_many_arguments)]
fn sgemm_rows(
    trans_a: bool,
    trans_b: bool,
    m_total: usize,
    rows: std::ops::Range<usize>,
    n: usize,
    k: usize,
    alpha: f32,
    a: &[f32],
    b: &[f32],
    beta: f32,
    c_rows: &mut [f32],
) {
    let m = rows.len();
    if m == 0 || n == 0 {
        return;
    }
    // Row-major A is m x k (rsa = k, csa = 1); stored transposed it is k x m_total.
    let (a_off, rsa, csa) = if trans_a {
        (rows.start, 1isize, m_total as isize)
    } else {
        (rows.start * k, k as isize, 1isize)
    };
    let (rsb, csb) = if trans_b {
        (1isize, k as isize)
    } else {
        (n as isize, 1isize)
    };
    if k == 0 {
        // matrixmultiply treats k = 0 as alpha * 0; do the beta scaling ourselves.
        for c in c_rows.iter_mut() {
            *c = if beta == 0.0 { 0.0 } else { beta * *c };
        }
        return;
    }
    if beta == 0.0 {
        // beta = 0 must ignore NaN/garbage in C; matrixmultiply multiplies it.
        c_rows.fill(0.0);
    }
    // SAFETY: the pointers and strides describe in-bounds matrices: A has at least
    // m_total*k elements (checked by the caller), this call touches rows `rows` of op(A);
    // B has k*n elements; c_rows has m*n elements with row stride n.
    unsafe {
        matrixmultiply::sgemm(
            m,
            k,
            n,
            alpha,
            a.as_ptr().add(a_off),
            rsa,
            csa,
            b.as_ptr(),
            rsb,
            csb,
            beta,
            c_rows.as_mut_ptr(),
            n as isize,
            1,
        );
    }
}

impl Backend for CpuBackend {
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

    fn upload_into(&self, buf: &mut Vec<f32>, offset: usize, host: &[f32]) -> Result<()> {
        need("upload_into", "buffer", buf.len(), offset + host.len())?;
        buf[offset..offset + host.len()].copy_from_slice(host);
        Ok(())
    }

    fn download(&self, buf: &Vec<f32>, offset: usize, out: &mut [f32]) -> Result<()> {
        need("download", "buffer", buf.len(), offset + out.len())?;
        out.copy_from_slice(&buf[offset..offset + out.len()]);
        Ok(())
    }

    fn upload_index(&self, host: &[u32]) -> Result<Vec<u32>> {
        Ok(host.to_vec())
    }

    fn index_len(&self, idx: &Vec<u32>) -> usize {
        idx.len()
    }

    fn fill(&self, buf: &mut Vec<f32>, len: usize, value: f32) -> Result<()> {
        need("fill", "buffer", buf.len(), len)?;
        self.timed(Kind::Other("fill"), || {
            buf[..len]
                .par_chunks_mut(ELEM_CHUNK)
                .for_each(|c| c.fill(value))
        });
        Ok(())
    }

    fn copy(&self, src: &Vec<f32>, dst: &mut Vec<f32>, len: usize) -> Result<()> {
        need("copy", "src", src.len(), len)?;
        need("copy", "dst", dst.len(), len)?;
        self.timed(Kind::Other("copy"), || {
            dst[..len]
                .par_chunks_mut(ELEM_CHUNK)
                .zip(src[..len].par_chunks(ELEM_CHUNK))
                .for_each(|(d, s)| d.copy_from_slice(s))
        });
        Ok(())
    }

    fn synchronize(&self) -> Result<()> {
        Ok(())
    }

    fn gather_rows(
        &self,
        src: &Vec<f32>,
        cols: usize,
        idx: &Vec<u32>,
        out: &mut Vec<f32>,
    ) -> Result<()> {
        need("gather_rows", "out", out.len(), idx.len() * cols)?;
        if let Some(&bad) = idx.iter().find(|&&r| (r as usize + 1) * cols > src.len()) {
            return Err(shape_err(
                "gather_rows",
                format!("row {bad} is outside src ({} elements)", src.len()),
            ));
        }
        if cols == 0 {
            return Ok(());
        }
        self.timed(Kind::Other("gather_rows"), || {
            out[..idx.len() * cols]
                .par_chunks_mut(cols)
                .zip(idx.par_iter())
                .for_each(|(o, &r)| {
                    o.copy_from_slice(&src[r as usize * cols..(r as usize + 1) * cols])
                })
        });
        Ok(())
    }

    fn scatter_add_rows(
        &self,
        src: &Vec<f32>,
        cols: usize,
        idx: &Vec<u32>,
        out: &mut Vec<f32>,
    ) -> Result<()> {
        need("scatter_add_rows", "src", src.len(), idx.len() * cols)?;
        if let Some(&bad) = idx.iter().find(|&&r| (r as usize + 1) * cols > out.len()) {
            return Err(shape_err(
                "scatter_add_rows",
                format!("row {bad} is outside out ({} elements)", out.len()),
            ));
        }
        // Sequential on purpose: repeated ids must add up in a fixed order, and this runs on
        // halo rows only.
        self.timed(Kind::Other("scatter_add_rows"), || {
            for (i, &r) in idx.iter().enumerate() {
                let o = &mut out[r as usize * cols..(r as usize + 1) * cols];
                for (a, &b) in o.iter_mut().zip(&src[i * cols..(i + 1) * cols]) {
                    *a += b;
                }
            }
        });
        Ok(())
    }

    fn gemm(
        &self,
        trans_a: bool,
        trans_b: bool,
        m: usize,
        n: usize,
        k: usize,
        alpha: f32,
        a: &Vec<f32>,
        b: &Vec<f32>,
        beta: f32,
        c: &mut Vec<f32>,
    ) -> Result<()> {
        need("gemm", "A", a.len(), m * k)?;
        need("gemm", "B", b.len(), k * n)?;
        need("gemm", "C", c.len(), m * n)?;
        if m == 0 || n == 0 {
            return Ok(());
        }
        self.timed(Kind::Gemm, || {
            let c = &mut c[..m * n];
            // A long inner dimension with a small output (weight gradients X^T G): split k
            // into fixed chunks, compute partial products in parallel, add them in order.
            if k >= 4 * RED_CHUNK && m * n <= 1 << 16 {
                let n_chunks = k.div_ceil(RED_CHUNK);
                let partials: Vec<Vec<f32>> = (0..n_chunks)
                    .into_par_iter()
                    .map(|ch| {
                        let k0 = ch * RED_CHUNK;
                        let k1 = (k0 + RED_CHUNK).min(k);
                        let kk = k1 - k0;
                        let mut p = vec![0.0f32; m * n];
                        // Slice the k range out of A and B by adjusting base pointers.
                        let (a_base, rsa, csa) = if trans_a {
                            (k0 * m, 1isize, m as isize)
                        } else {
                            (k0, k as isize, 1isize)
                        };
                        let (b_base, rsb, csb) = if trans_b {
                            (k0, 1isize, k as isize)
                        } else {
                            (k0 * n, n as isize, 1isize)
                        };
                        // SAFETY: element (i, p) of the A slice is at
                        // a_base + i*rsa + p*csa < m*k for i < m, p < kk (k0 + p < k), and
                        // likewise for B; p has m*n elements.
                        unsafe {
                            matrixmultiply::sgemm(
                                m,
                                kk,
                                n,
                                1.0,
                                a.as_ptr().add(a_base),
                                rsa,
                                csa,
                                b.as_ptr().add(b_base),
                                rsb,
                                csb,
                                0.0,
                                p.as_mut_ptr(),
                                n as isize,
                                1,
                            );
                        }
                        p
                    })
                    .collect();
                let mut total = vec![0.0f32; m * n];
                for p in partials {
                    for (t, v) in total.iter_mut().zip(p) {
                        *t += v;
                    }
                }
                for (ci, t) in c.iter_mut().zip(total) {
                    *ci = if beta == 0.0 {
                        alpha * t
                    } else {
                        alpha * t + beta * *ci
                    };
                }
            } else if !trans_a && k * n <= SKINNY_MAX_B && m >= 4 * ROW_CHUNK {
                // Tall-skinny products (activations times a weight matrix): a register-blocked
                // kernel that keeps B in L1 and never packs A beats a general GEMM here.
                let bt;
                let b_rows: &[f32] = if trans_b {
                    // B is stored n x k; make the k x n copy once (it is a weight: small).
                    let mut t = vec![0.0f32; k * n];
                    for j in 0..n {
                        for p in 0..k {
                            t[p * n + j] = b[j * k + p];
                        }
                    }
                    bt = t;
                    &bt
                } else {
                    &b[..k * n]
                };
                let level = simd_level();
                c.par_chunks_mut(ROW_CHUNK * n)
                    .enumerate()
                    .for_each(|(ch, c_rows)| {
                        let r0 = ch * ROW_CHUNK;
                        let rows = c_rows.len() / n;
                        let a_rows = &a[r0 * k..(r0 + rows) * k];
                        let sk = Skinny { k, n, alpha, beta };
                        // SAFETY: the level only names features this CPU has.
                        unsafe { sk.dispatch(level, a_rows, b_rows, c_rows) }
                    });
            } else {
                // Independent row blocks of C.
                let rows_per = ROW_CHUNK.max(1);
                c.par_chunks_mut(rows_per * n)
                    .enumerate()
                    .for_each(|(ch, c_rows)| {
                        let r0 = ch * rows_per;
                        let r1 = r0 + c_rows.len() / n;
                        sgemm_rows(trans_a, trans_b, m, r0..r1, n, k, alpha, a, b, beta, c_rows);
                    });
            }
        });
        Ok(())
    }

    fn add_bias(&self, x: &mut Vec<f32>, bias: &Vec<f32>, rows: usize, cols: usize) -> Result<()> {
        need("add_bias", "x", x.len(), rows * cols)?;
        need("add_bias", "bias", bias.len(), cols)?;
        if cols == 0 {
            return Ok(());
        }
        self.timed(Kind::Other("add_bias"), || {
            x[..rows * cols].par_chunks_mut(cols).for_each(|r| {
                for (a, &b) in r.iter_mut().zip(&bias[..cols]) {
                    *a += b;
                }
            })
        });
        Ok(())
    }

    fn col_sum(
        &self,
        x: &Vec<f32>,
        rows: usize,
        cols: usize,
        beta: f32,
        out: &mut Vec<f32>,
    ) -> Result<()> {
        need("col_sum", "x", x.len(), rows * cols)?;
        need("col_sum", "out", out.len(), cols)?;
        self.timed(Kind::Other("col_sum"), || {
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

    fn upload_graph(&self, g: &BlockGraph) -> Result<CpuGraph> {
        g.validate()?;
        let start = Instant::now();
        let fwd = Csr {
            offsets: g.offsets.iter().map(|&o| o as usize).collect(),
            indices: g.indices.clone(),
            dst: g.dst_scale.clone(),
            src: g.src_scale.clone(),
            self_: g.self_scale.clone(),
        };
        // Transpose: row u (< n_src) lists the destinations v whose rows contain u. Visiting
        // destinations in order keeps every transposed row sorted.
        let mut t_off = vec![0usize; g.n_src + 1];
        for &u in &g.indices {
            t_off[u as usize + 1] += 1;
        }
        for i in 0..g.n_src {
            t_off[i + 1] += t_off[i];
        }
        let mut cursor = t_off.clone();
        let mut t_idx = vec![0u32; g.indices.len()];
        for v in 0..g.n_dst {
            for &u in &g.indices[fwd.offsets[v]..fwd.offsets[v + 1]] {
                let slot = &mut cursor[u as usize];
                t_idx[*slot] = v as u32;
                *slot += 1;
            }
        }
        // In A^T the roles of the scales swap; the self term only exists for u < n_dst.
        let bwd = Csr {
            offsets: t_off,
            indices: t_idx,
            dst: g.src_scale.clone().unwrap_or_else(|| vec![1.0; g.n_src]),
            src: Some(g.dst_scale.clone()),
            self_: g.self_scale.as_ref().map(|s| {
                let mut full = s.clone();
                full.resize(g.n_src, 0.0);
                full
            }),
        };
        tracing::debug!(
            "uploaded graph block {}x{} with {} edges in {:.3}s",
            g.n_dst,
            g.n_src,
            g.indices.len(),
            start.elapsed().as_secs_f64()
        );
        Ok(CpuGraph {
            fwd,
            bwd,
            n_dst: g.n_dst,
            n_src: g.n_src,
        })
    }

    fn graph_dims(&self, g: &CpuGraph) -> (usize, usize, usize) {
        (g.n_dst, g.n_src, g.fwd.indices.len())
    }

    fn aggregate(&self, g: &CpuGraph, x: &Vec<f32>, d: usize, out: &mut Vec<f32>) -> Result<()> {
        need("aggregate", "x", x.len(), g.n_src * d)?;
        need("aggregate", "out", out.len(), g.n_dst * d)?;
        if d == 0 {
            return Ok(());
        }
        self.timed(Kind::Agg, || g.fwd.run(x, d, out));
        let bytes = (g.fwd.indices.len() * (d * 4 + 4) + g.n_dst * d * 4) as u64;
        self.timers.agg_bytes.fetch_add(bytes, Ordering::Relaxed);
        Ok(())
    }

    fn aggregate_backward(
        &self,
        g: &CpuGraph,
        grad_out: &Vec<f32>,
        d: usize,
        grad_x: &mut Vec<f32>,
    ) -> Result<()> {
        need(
            "aggregate_backward",
            "grad_out",
            grad_out.len(),
            g.n_dst * d,
        )?;
        need("aggregate_backward", "grad_x", grad_x.len(), g.n_src * d)?;
        if d == 0 {
            return Ok(());
        }
        self.timed(Kind::Agg, || g.bwd.run(grad_out, d, grad_x));
        let bytes = (g.bwd.indices.len() * (d * 4 + 4) + g.n_src * d * 4) as u64;
        self.timers.agg_bytes.fetch_add(bytes, Ordering::Relaxed);
        Ok(())
    }

    fn relu(&self, x: &Vec<f32>, out: &mut Vec<f32>, len: usize) -> Result<()> {
        need("relu", "x", x.len(), len)?;
        need("relu", "out", out.len(), len)?;
        self.timed(Kind::Other("relu"), || {
            out[..len]
                .par_chunks_mut(ELEM_CHUNK)
                .zip(x[..len].par_chunks(ELEM_CHUNK))
                .for_each(|(o, i)| {
                    for (a, &b) in o.iter_mut().zip(i) {
                        *a = b.max(0.0);
                    }
                })
        });
        Ok(())
    }

    fn relu_backward(&self, y: &Vec<f32>, grad: &mut Vec<f32>, len: usize) -> Result<()> {
        need("relu_backward", "y", y.len(), len)?;
        need("relu_backward", "grad", grad.len(), len)?;
        self.timed(Kind::Other("relu_backward"), || {
            grad[..len]
                .par_chunks_mut(ELEM_CHUNK)
                .zip(y[..len].par_chunks(ELEM_CHUNK))
                .for_each(|(g, y)| {
                    for (a, &b) in g.iter_mut().zip(y) {
                        *a = if b > 0.0 { *a } else { 0.0 };
                    }
                })
        });
        Ok(())
    }

    fn dropout(
        &self,
        x: &Vec<f32>,
        out: &mut Vec<f32>,
        rows: usize,
        cols: usize,
        global_ids: &Vec<u32>,
        p: f32,
        key: DropoutKey,
    ) -> Result<()> {
        need("dropout", "x", x.len(), rows * cols)?;
        need("dropout", "out", out.len(), rows * cols)?;
        need("dropout", "global_ids", global_ids.len(), rows)?;
        if !(0.0..1.0).contains(&p) {
            return Err(shape_err(
                "dropout",
                format!("p must be in [0, 1), got {p}"),
            ));
        }
        if cols == 0 {
            return Ok(());
        }
        let stream = key.stream();
        let thr = dropout_threshold(p);
        let scale = 1.0 / (1.0 - p);
        let level = simd_level();
        self.timed(Kind::Other("dropout"), || {
            out[..rows * cols]
                .par_chunks_mut(ROW_CHUNK * cols)
                .zip(x[..rows * cols].par_chunks(ROW_CHUNK * cols))
                .zip(global_ids[..rows].par_chunks(ROW_CHUNK))
                .for_each(|((o, i), ids)| {
                    let m = Mask {
                        stream,
                        thr,
                        scale,
                        cols,
                    };
                    // SAFETY: the level only names features this CPU has.
                    unsafe { m.dispatch(level, ids, Some(i), o) }
                })
        });
        Ok(())
    }

    fn dropout_backward(
        &self,
        grad: &mut Vec<f32>,
        rows: usize,
        cols: usize,
        global_ids: &Vec<u32>,
        p: f32,
        key: DropoutKey,
    ) -> Result<()> {
        need("dropout_backward", "grad", grad.len(), rows * cols)?;
        need("dropout_backward", "global_ids", global_ids.len(), rows)?;
        if !(0.0..1.0).contains(&p) {
            return Err(shape_err(
                "dropout_backward",
                format!("p must be in [0, 1), got {p}"),
            ));
        }
        if cols == 0 || p == 0.0 {
            return Ok(());
        }
        let stream = key.stream();
        let thr = dropout_threshold(p);
        let scale = 1.0 / (1.0 - p);
        let level = simd_level();
        self.timed(Kind::Other("dropout_backward"), || {
            grad[..rows * cols]
                .par_chunks_mut(ROW_CHUNK * cols)
                .zip(global_ids[..rows].par_chunks(ROW_CHUNK))
                .for_each(|(g, ids)| {
                    let m = Mask {
                        stream,
                        thr,
                        scale,
                        cols,
                    };
                    // SAFETY: the level only names features this CPU has.
                    unsafe { m.dispatch(level, ids, None, g) }
                })
        });
        Ok(())
    }

    fn axpy(&self, alpha: f32, x: &Vec<f32>, y: &mut Vec<f32>, len: usize) -> Result<()> {
        need("axpy", "x", x.len(), len)?;
        need("axpy", "y", y.len(), len)?;
        self.timed(Kind::Other("axpy"), || {
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

    fn scale(&self, x: &mut Vec<f32>, alpha: f32, len: usize) -> Result<()> {
        need("scale", "x", x.len(), len)?;
        self.timed(Kind::Other("scale"), || {
            x[..len]
                .par_chunks_mut(ELEM_CHUNK)
                .for_each(|c| c.iter_mut().for_each(|a| *a *= alpha))
        });
        Ok(())
    }

    fn layer_norm(
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
        need("layer_norm", "x", x.len(), rows * cols)?;
        need("layer_norm", "out", out.len(), rows * cols)?;
        need("layer_norm", "gamma", gamma.len(), cols)?;
        need("layer_norm", "beta", beta.len(), cols)?;
        need("layer_norm", "mean", mean.len(), rows)?;
        need("layer_norm", "rstd", rstd.len(), rows)?;
        if cols == 0 {
            return Ok(());
        }
        self.timed(Kind::Other("layer_norm"), || {
            out[..rows * cols]
                .par_chunks_mut(cols)
                .zip(x[..rows * cols].par_chunks(cols))
                .zip(mean[..rows].par_iter_mut().zip(rstd[..rows].par_iter_mut()))
                .for_each(|((o, xr), (mu, rs))| {
                    let n = cols as f32;
                    let m = xr.iter().sum::<f32>() / n;
                    let var = xr.iter().map(|&v| (v - m) * (v - m)).sum::<f32>() / n;
                    let r = 1.0 / (var + eps).sqrt();
                    *mu = m;
                    *rs = r;
                    for ((a, &v), (&g, &b)) in o.iter_mut().zip(xr).zip(gamma.iter().zip(beta)) {
                        *a = (v - m) * r * g + b;
                    }
                })
        });
        Ok(())
    }

    fn layer_norm_backward(
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
        let op = "layer_norm_backward";
        need(op, "grad_out", grad_out.len(), rows * cols)?;
        need(op, "x", x.len(), rows * cols)?;
        need(op, "grad_x", grad_x.len(), rows * cols)?;
        need(op, "gamma", gamma.len(), cols)?;
        need(op, "grad_gamma", grad_gamma.len(), cols)?;
        need(op, "grad_beta", grad_beta.len(), cols)?;
        need(op, "mean", mean.len(), rows)?;
        need(op, "rstd", rstd.len(), rows)?;
        if cols == 0 {
            return Ok(());
        }
        self.timed(Kind::Other("layer_norm_backward"), || {
            // dx = rstd * (gy*gamma - mean(gy*gamma) - xhat * mean(gy*gamma*xhat))
            grad_x[..rows * cols]
                .par_chunks_mut(cols)
                .enumerate()
                .for_each(|(r, gx)| {
                    let xr = &x[r * cols..(r + 1) * cols];
                    let gy = &grad_out[r * cols..(r + 1) * cols];
                    let (m, rs) = (mean[r], rstd[r]);
                    let n = cols as f32;
                    let mut s1 = 0.0f32;
                    let mut s2 = 0.0f32;
                    for j in 0..cols {
                        let xh = (xr[j] - m) * rs;
                        let gg = gy[j] * gamma[j];
                        s1 += gg;
                        s2 += gg * xh;
                    }
                    let (s1, s2) = (s1 / n, s2 / n);
                    for j in 0..cols {
                        let xh = (xr[j] - m) * rs;
                        gx[j] = rs * (gy[j] * gamma[j] - s1 - xh * s2);
                    }
                });
            let sums = ordered_partials(rows.div_ceil(RED_CHUNK), 2 * cols, |ch, p| {
                let r0 = ch * RED_CHUNK;
                let r1 = (r0 + RED_CHUNK).min(rows);
                for r in r0..r1 {
                    let (m, rs) = (mean[r], rstd[r]);
                    for j in 0..cols {
                        let g = grad_out[r * cols + j];
                        let xh = (x[r * cols + j] - m) * rs;
                        p[j] += (g * xh) as f64;
                        p[cols + j] += g as f64;
                    }
                }
            });
            for j in 0..cols {
                grad_gamma[j] += sums[j] as f32;
                grad_beta[j] += sums[cols + j] as f32;
            }
        });
        Ok(())
    }

    fn cross_entropy(
        &self,
        logits: &Vec<f32>,
        n: usize,
        classes: usize,
        rows: &Vec<u32>,
        labels: &Vec<u32>,
        normalizer: f32,
        grad: &mut Vec<f32>,
    ) -> Result<f64> {
        let op = "cross_entropy";
        need(op, "logits", logits.len(), n * classes)?;
        need(op, "grad", grad.len(), n * classes)?;
        if rows.len() != labels.len() {
            return Err(shape_err(
                op,
                format!("{} rows but {} labels", rows.len(), labels.len()),
            ));
        }
        if let Some(&r) = rows.iter().find(|&&r| r as usize >= n) {
            return Err(shape_err(op, format!("row {r} out of range (n = {n})")));
        }
        if let Some(&l) = labels.iter().find(|&&l| l as usize >= classes) {
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
        let loss = self.timed(Kind::Other("cross_entropy"), || {
            grad[..n * classes]
                .par_chunks_mut(ELEM_CHUNK)
                .for_each(|c| c.fill(0.0));
            let inv = 1.0 / normalizer;
            // Per selected row: loss term and gradient row. Rows are computed in parallel,
            // written sequentially (ids may repeat in principle), summed in order.
            let terms: Vec<(f64, Vec<f32>)> = rows
                .par_iter()
                .zip(labels.par_iter())
                .map(|(&r, &l)| {
                    let z = &logits[r as usize * classes..(r as usize + 1) * classes];
                    let mx = z.iter().cloned().fold(f32::NEG_INFINITY, f32::max);
                    let sum: f64 = z.iter().map(|&v| ((v - mx) as f64).exp()).sum();
                    let lse = mx as f64 + sum.ln();
                    let g: Vec<f32> = z
                        .iter()
                        .enumerate()
                        .map(|(c, &v)| {
                            let p = ((v as f64) - lse).exp();
                            let t = if c == l as usize { 1.0 } else { 0.0 };
                            ((p - t) as f32) * inv
                        })
                        .collect();
                    (lse - z[l as usize] as f64, g)
                })
                .collect();
            let mut total = 0.0f64;
            for (&r, (t, g)) in rows.iter().zip(terms) {
                total += t;
                for (a, b) in grad[r as usize * classes..(r as usize + 1) * classes]
                    .iter_mut()
                    .zip(g)
                {
                    *a += b;
                }
            }
            total
        });
        Ok(loss)
    }

    fn sum_squares(&self, x: &Vec<f32>, len: usize) -> Result<f64> {
        need("sum_squares", "x", x.len(), len)?;
        Ok(self.timed(Kind::Other("sum_squares"), || {
            ordered_partials(len.div_ceil(ELEM_CHUNK), 1, |ch, p| {
                let s = ch * ELEM_CHUNK;
                let e = (s + ELEM_CHUNK).min(len);
                p[0] = x[s..e].iter().map(|&v| (v as f64) * (v as f64)).sum();
            })[0]
        }))
    }

    fn adam_step(
        &self,
        param: &mut Vec<f32>,
        grad: &Vec<f32>,
        m: &mut Vec<f32>,
        v: &mut Vec<f32>,
        len: usize,
        s: &AdamStep,
    ) -> Result<()> {
        for (what, have) in [
            ("param", param.len()),
            ("grad", grad.len()),
            ("m", m.len()),
            ("v", v.len()),
        ] {
            need("adam_step", what, have, len)?;
        }
        if s.step == 0 {
            return Err(shape_err("adam_step", "step counter must start at 1"));
        }
        let bc1 = 1.0 - (s.beta1 as f64).powf(s.step as f64);
        let bc2 = 1.0 - (s.beta2 as f64).powf(s.step as f64);
        let (bc1, bc2) = (bc1 as f32, bc2 as f32);
        let s = *s;
        self.timed(Kind::Other("adam_step"), || {
            param[..len]
                .par_chunks_mut(ELEM_CHUNK)
                .zip(grad[..len].par_chunks(ELEM_CHUNK))
                .zip(m[..len].par_chunks_mut(ELEM_CHUNK))
                .zip(v[..len].par_chunks_mut(ELEM_CHUNK))
                .for_each(|(((w, g), m), v)| {
                    for i in 0..w.len() {
                        let mut gi = g[i] * s.grad_scale;
                        if !s.decoupled {
                            gi += s.weight_decay * w[i];
                        }
                        m[i] = s.beta1 * m[i] + (1.0 - s.beta1) * gi;
                        v[i] = s.beta2 * v[i] + (1.0 - s.beta2) * gi * gi;
                        let m_hat = m[i] / bc1;
                        let v_hat = v[i] / bc2;
                        if s.decoupled {
                            w[i] -= s.lr * s.weight_decay * w[i];
                        }
                        w[i] -= s.lr * m_hat / (v_hat.sqrt() + s.eps);
                    }
                })
        });
        Ok(())
    }
}
