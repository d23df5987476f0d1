//! CSR aggregation kernels: the uploaded graph block (forward CSR and its transpose) and the register-blocked, prefetching gather behind `aggregate` / `aggregate_backward`.

use super::simd::{self, simd_level, Kernel};
use super::ROW_CHUNK;
use crate::block::{BlockGraph, ScaledCsr};
use rayon::prelude::*;

/// An uploaded graph block: forward CSR and its transpose, with their scale vectors.
pub struct CpuGraph {
    pub(super) fwd: Csr,
    pub(super) bwd: Csr,
    pub(super) n_dst: usize,
    pub(super) n_src: usize,
}

/// `out[v] = dst[v] * sum_{u in row v} src[u] * x[u] + self_[v] * x[v]`.
pub(super) struct Csr {
    offsets: Vec<usize>,
    pub(super) indices: Vec<u32>,
    dst: Vec<f32>,
    src: Option<Vec<f32>>,
    self_: Option<Vec<f32>>,
}

impl Csr {
    /// The ids listed in row `v`.
    pub(super) fn row(&self, v: usize) -> &[u32] {
        &self.indices[self.offsets[v]..self.offsets[v + 1]]
    }

    /// The kernel shared by forward (A) and backward (A^T): parallel over output rows. Each
    /// row is computed in column blocks whose accumulators live in registers, reading the
    /// neighbour rows in CSR order with software prefetch a few neighbours ahead (the gather
    /// is latency-bound otherwise). The arithmetic order is the same on every instruction set
    /// (no FMA contraction), so results do not depend on the CPU it runs on.
    pub(super) fn run(&self, x: &[f32], d: usize, out: &mut [f32]) {
        let n_rows = self.offsets.len() - 1;
        let level = simd_level();
        out[..n_rows * d]
            .par_chunks_mut(ROW_CHUNK * d)
            .enumerate()
            .for_each(|(chunk, rows)| {
                let first = chunk * ROW_CHUNK;
                simd::run(
                    level,
                    CsrRows {
                        csr: self,
                        first,
                        rows,
                        x,
                        d,
                    },
                )
            });
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

/// [`Csr::run`] on the output rows `first..` (a multiple of `d` values in `rows`).
struct CsrRows<'a> {
    csr: &'a Csr,
    first: usize,
    rows: &'a mut [f32],
    x: &'a [f32],
    d: usize,
}

impl Kernel for CsrRows<'_> {
    type Out = ();
    #[inline(always)]
    fn run(self) {
        // SAFETY: `rows_kernel`'s preconditions (validated graph, x holding n_src * d values)
        // are checked by the callers of `Csr::run` (`aggregate`, `aggregate_backward`).
        unsafe { self.csr.rows_kernel(self.first, self.rows, self.x, self.d) }
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

pub(super) use grandis_store::prefetch;

/// A validated block and its transpose as the CPU kernels take them.
pub(super) fn upload_block(g: &BlockGraph, t: &ScaledCsr) -> CpuGraph {
    let offsets = |o: &[u64]| o.iter().map(|&o| o as usize).collect();
    let fwd = Csr {
        offsets: offsets(&g.offsets),
        indices: g.indices.clone(),
        dst: g.dst_scale.clone(),
        src: g.src_scale.clone(),
        self_: g.self_scale.clone(),
    };
    let bwd = Csr {
        offsets: offsets(&t.offsets),
        indices: t.indices.clone(),
        dst: t.dst.clone(),
        src: t.src.clone(),
        self_: t.self_.clone(),
    };
    CpuGraph {
        fwd,
        bwd,
        n_dst: g.n_dst,
        n_src: g.n_src,
    }
}
