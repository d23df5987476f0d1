//! GAT attention kernels behind `attention_aggregate` / `attention_aggregate_backward`: a
//! forward pass over destination rows, and a backward in two passes (destinations, then
//! sources through the transposed CSR) that recomputes every coefficient from the scores and
//! the saved log-sum-exp instead of storing one per edge and head.
//!
//! Each pass visits an edge once and handles all its heads together (the scores of a row's
//! heads are contiguous), with [`exp_nonpositive`], a polynomial `exp` that vectorises across
//! heads and that the CUDA kernels repeat operation by operation.

// The loops walk several per-head arrays in step; indices say that more plainly than zips.
#![allow(clippy::needless_range_loop)]

use super::aggregate::{prefetch, CpuGraph};
use super::simd::{run, simd_level, Kernel};
use super::ROW_CHUNK;
use crate::args::{attention_row_stream, dropout_keep};
use rayon::prelude::*;

/// `exp(x)` for `x <= 0` (what softmax needs: every exponent is a logit minus its row's
/// maximum or log-sum-exp), within 2 ulp of the exact value; 0 below -87 (where `f32`
/// results become denormal). Cody–Waite reduction `x = n ln 2 + r` (`n` rounded to
/// nearest), a degree-6 polynomial
/// for `exp(r)` (Cephes' `expf` coefficients), and `2^n` from its exponent bits. No fused
/// multiply-add, so every instruction set, and the CUDA kernel `exp_nonpositive`, gives the
/// same bits.
#[inline(always)]
pub fn exp_nonpositive(x: f32) -> f32 {
    // n = round(x log2 e) by the 1.5 * 2^23 trick (no floor: it is a libm call without
    // SSE4.1, and it must not keep the loop from vectorising).
    let n = (x * std::f32::consts::LOG2_E + 12_582_912.0) - 12_582_912.0;
    let r = x - n * 0.693_359_4 - n * -2.121_944_4e-4;
    let mut p = 1.987_569_1e-4 * r + 1.398_199_9e-3;
    p = p * r + 8.333_452e-3;
    p = p * r + 4.166_579_6e-2;
    p = p * r + 1.666_666_6e-1;
    p = p * r + 0.5;
    let y = p * (r * r) + r + 1.0;
    let scale = f32::from_bits((((n.max(-126.0) as i32) + 127) as u32) << 23);
    if x < -87.0 {
        0.0
    } else {
        y * scale
    }
}

/// The constants of one attention call, resolved on the host.
pub(super) struct AttnCall<'a> {
    pub heads: usize,
    pub head_dim: usize,
    pub concat: bool,
    pub slope: f32,
    /// [`crate::Attention::self_loops`].
    pub self_loops: bool,
    /// `(global ids, stream, threshold, 1 / (1 - p))` when dropping coefficients.
    pub drop: Option<(&'a [u32], u64, u32, f32)>,
}

impl AttnCall<'_> {
    fn in_cols(&self) -> usize {
        self.heads * self.head_dim
    }
    fn out_cols(&self) -> usize {
        if self.concat {
            self.in_cols()
        } else {
            self.head_dim
        }
    }
    #[inline(always)]
    fn leaky(&self, x: f32) -> f32 {
        if x > 0.0 {
            x
        } else {
            self.slope * x
        }
    }
    #[inline(always)]
    fn leaky_grad(&self, x: f32) -> f32 {
        if x > 0.0 {
            1.0
        } else {
            self.slope
        }
    }
    /// The mask stream of destination `v` (`attention_keep`'s inner stream), 0 without
    /// dropout.
    #[inline(always)]
    fn row_stream(&self, v: usize) -> u64 {
        self.drop.map_or(0, |(ids, stream, _, _)| {
            attention_row_stream(stream, ids[v])
        })
    }
    /// The dropout multiplier of the coefficient of `u -> v` in head `h`, given `v`'s
    /// [`Self::row_stream`].
    #[inline(always)]
    fn keep_scale(&self, row_stream: u64, u: usize, h: usize) -> f32 {
        match self.drop {
            None => 1.0,
            Some((ids, _, thr, scale)) => {
                if dropout_keep(row_stream, thr, ids[u], h as u32) {
                    scale
                } else {
                    0.0
                }
            }
        }
    }
    /// Head `h`'s columns of row `row` of an `H * F`-column matrix (`x`).
    #[inline(always)]
    fn head<'m>(&self, m: &'m [f32], row: usize, h: usize) -> &'m [f32] {
        let (f, c) = (self.head_dim, self.in_cols());
        &m[row * c + h * f..row * c + h * f + f]
    }
    /// The gradient of head `h`'s output of destination `v` and its factor (`1 / H` when the
    /// heads are averaged).
    #[inline(always)]
    fn grad_of<'g>(&self, g: &'g [f32], v: usize, h: usize) -> (&'g [f32], f32) {
        let f = self.head_dim;
        let oc = self.out_cols();
        if self.concat {
            (&g[v * oc + h * f..v * oc + h * f + f], 1.0)
        } else {
            (&g[v * oc..v * oc + f], 1.0 / self.heads as f32)
        }
    }
}

/// The sources of destination `v` in attention order: with self-loops, its row without its
/// own loops, then `v`; without, its row as it is.
fn sources<'g>(g: &'g CpuGraph, p: &AttnCall<'_>, v: usize) -> impl Iterator<Item = usize> + 'g {
    let self_loops = p.self_loops;
    g.fwd
        .row(v)
        .iter()
        .map(|&u| u as usize)
        .filter(move |&u| !self_loops || u != v)
        .chain(self_loops.then_some(v))
}

#[inline(always)]
fn dot(a: &[f32], b: &[f32]) -> f32 {
    let mut s = 0.0f32;
    for (x, y) in a.iter().zip(b) {
        s += x * y;
    }
    s
}

/// Per-task buffers, reused across the rows of a chunk.
#[derive(Default)]
struct RowBuffers {
    srcs: Vec<usize>,
    /// One value per (source, head).
    a: Vec<f32>,
    b: Vec<f32>,
    c: Vec<f32>,
    /// One value per head.
    h1: Vec<f32>,
    h2: Vec<f32>,
}

impl RowBuffers {
    fn load(&mut self, g: &CpuGraph, p: &AttnCall<'_>, v: usize) {
        let heads = p.heads;
        self.srcs.clear();
        self.srcs.extend(sources(g, p, v));
        let n = self.srcs.len() * heads;
        for buf in [&mut self.a, &mut self.b, &mut self.c] {
            buf.clear();
            buf.resize(n, 0.0);
        }
        self.h1.clear();
        self.h1.resize(heads, 0.0);
        self.h2.clear();
        self.h2.resize(heads, 0.0);
    }
}

/// Sources to look ahead when prefetching their rows (the gathers are latency-bound).
const AHEAD: usize = 6;

/// Prefetches the `len` floats at `base[row * width..]` (whole cache lines).
#[inline(always)]
fn prefetch_row(base: &[f32], row: usize, width: usize, len: usize) {
    let p = base.as_ptr().wrapping_add(row * width);
    let mut off = 0;
    while off < len {
        prefetch(p.wrapping_add(off));
        off += 16;
    }
}

/// What every pass reads: the block, the call's constants, the attended rows `x` and their
/// scores.
#[derive(Clone, Copy)]
struct Inputs<'a, 'p> {
    g: &'a CpuGraph,
    p: &'a AttnCall<'p>,
    x: &'a [f32],
    scores: &'a [f32],
}

impl Inputs<'_, '_> {
    /// Prefetches what a destination reads of source `u`: its source scores and feature row.
    #[inline(always)]
    fn prefetch_source(&self, u: usize) {
        let (hs, c) = (self.p.heads, self.p.in_cols());
        prefetch_row(self.scores, u, 2 * hs, hs);
        prefetch_row(self.x, u, c, c);
    }
}

pub(super) fn forward(
    g: &CpuGraph,
    p: &AttnCall<'_>,
    x: &[f32],
    scores: &[f32],
    out: &mut [f32],
    lse: &mut [f32],
) {
    let (hs, oc) = (p.heads, p.out_cols());
    let level = simd_level();
    let inp = Inputs { g, p, x, scores };
    out[..g.n_dst * oc]
        .par_chunks_mut(ROW_CHUNK * oc)
        .zip(lse[..g.n_dst * hs].par_chunks_mut(ROW_CHUNK * hs))
        .enumerate()
        .for_each(|(chunk, (out_rows, lse_rows))| {
            let first = chunk * ROW_CHUNK;
            run(
                level,
                ForwardRows {
                    inp,
                    first,
                    out_rows,
                    lse_rows,
                },
            )
        });
}

/// [`forward`] on the destinations `first..` whose output and log-sum-exp rows are given.
struct ForwardRows<'a, 'p> {
    inp: Inputs<'a, 'p>,
    first: usize,
    out_rows: &'a mut [f32],
    lse_rows: &'a mut [f32],
}

impl Kernel for ForwardRows<'_, '_> {
    type Out = ();
    #[inline(always)]
    fn run(self) {
        let ForwardRows {
            inp,
            first,
            out_rows,
            lse_rows,
        } = self;
        let Inputs { g, p, x, scores } = inp;
        let (hs, f, c, oc) = (p.heads, p.head_dim, p.in_cols(), p.out_cols());
        let two_h = 2 * hs;
        let mut s = RowBuffers::default();
        for (i, (orow, lrow)) in out_rows
            .chunks_exact_mut(oc)
            .zip(lse_rows.chunks_exact_mut(hs))
            .enumerate()
        {
            let v = first + i;
            s.load(g, p, v);
            let sd = &scores[v * two_h + hs..v * two_h + two_h];
            // Logits (in `a`) and their maximum per head (`h1`); the sources' feature rows are
            // fetched meanwhile for the weighted sum below.
            s.h1.fill(f32::NEG_INFINITY);
            for (j, &u) in s.srcs.iter().enumerate() {
                if let Some(&ahead) = s.srcs.get(j + AHEAD) {
                    inp.prefetch_source(ahead);
                }
                let su = &scores[u * two_h..u * two_h + hs];
                let e = &mut s.a[j * hs..j * hs + hs];
                for h in 0..hs {
                    e[h] = p.leaky(su[h] + sd[h]);
                    s.h1[h] = s.h1[h].max(e[h]);
                }
            }
            // exp(e - max) in place, summed per head (`h2`).
            for j in 0..s.srcs.len() {
                let e = &mut s.a[j * hs..j * hs + hs];
                for h in 0..hs {
                    e[h] = exp_nonpositive(e[h] - s.h1[h]);
                    s.h2[h] += e[h];
                }
            }
            for h in 0..hs {
                // A destination without sources (no self-loop added) keeps 0, not -inf.
                lrow[h] = if s.h2[h] > 0.0 {
                    s.h1[h] + s.h2[h].ln()
                } else {
                    0.0
                };
            }
            // The dropout multipliers (in `b`), then the weighted sum head by head (averaged
            // heads add up in this order on every backend).
            let rs = p.row_stream(v);
            for (j, &u) in s.srcs.iter().enumerate() {
                for h in 0..hs {
                    s.b[j * hs + h] = p.keep_scale(rs, u, h);
                }
            }
            orow.fill(0.0);
            for h in 0..hs {
                let o = if p.concat {
                    &mut orow[h * f..h * f + f]
                } else {
                    &mut orow[..]
                };
                for (j, &u) in s.srcs.iter().enumerate() {
                    let a = s.a[j * hs + h] / s.h2[h] * s.b[j * hs + h];
                    let xr = &x[u * c + h * f..u * c + h * f + f];
                    for (o, &xv) in o.iter_mut().zip(xr) {
                        *o += a * xv;
                    }
                }
            }
            if !p.concat {
                let inv = 1.0 / hs as f32;
                for o in orow.iter_mut() {
                    *o *= inv;
                }
            }
        }
    }
}

#[allow(clippy::too_many_arguments)]
pub(super) fn backward(
    g: &CpuGraph,
    p: &AttnCall<'_>,
    x: &[f32],
    scores: &[f32],
    lse: &[f32],
    grad_out: &[f32],
    grad_x: &mut [f32],
    grad_scores: &mut [f32],
    scratch: &mut [f32],
) {
    let (hs, c) = (p.heads, p.in_cols());
    let two_h = 2 * hs;
    let level = simd_level();
    let inp = Inputs { g, p, x, scores };
    grad_scores[..g.n_dst * two_h]
        .par_chunks_mut(ROW_CHUNK * two_h)
        .zip(scratch[..g.n_dst * hs].par_chunks_mut(ROW_CHUNK * hs))
        .enumerate()
        .for_each(|(chunk, (gs_rows, sc_rows))| {
            let first = chunk * ROW_CHUNK;
            run(
                level,
                DestinationPass {
                    inp,
                    lse,
                    grad_out,
                    first,
                    gs_rows,
                    sc_rows,
                },
            )
        });
    let scratch = &*scratch;
    grad_x[..g.n_src * c]
        .par_chunks_mut(ROW_CHUNK * c)
        .zip(grad_scores[..g.n_src * two_h].par_chunks_mut(ROW_CHUNK * two_h))
        .enumerate()
        .for_each(|(chunk, (gx_rows, gs_rows))| {
            let first = chunk * ROW_CHUNK;
            run(
                level,
                SourcePass {
                    inp,
                    lse,
                    grad_out,
                    scratch,
                    first,
                    gx_rows,
                    gs_rows,
                },
            )
        });
}

/// Backward pass 1, per destination `v >= first` and head `h`: with `a_u = exp(e_u - lse)`
/// and `m_u` the dropout multiplier, the softmax's correction
/// `corr = sum_u a_u (m_u (g_v · x_u))`, kept in `scratch`, and the gradient of `v`'s
/// destination score, `sum_u a_u (m_u (g_v · x_u) - corr) leaky'(pre_u)`, computed as
/// `sum_u a_u (m_u (g_v · x_u) - corr) (leaky'(pre_u) - r)`: the same for any constant `r`,
/// as the softmax's terms `a_u (m_u (g_v · x_u) - corr)` add up to 0, and with `r` the
/// slope when every logit of `v` is below LeakyReLU's kink and 1 otherwise, exactly 0 (not
/// rounding noise) whenever every logit is on the same side of it. (With `r` = 1 always, a
/// destination whose logits were all below the kink kept the noise: seed 499371 of the
/// typed-graph property, 1.8e-4 after three epochs.) The destination score shifts
/// all of `v`'s logits alike, so a destination attending to no source of its own (R-GAT's
/// relations have no self-loop) gets most of its gradient from this sum: noise there became,
/// through Adam's normalised first step, differences of a whole learning rate between runs
/// that sum in different orders.
struct DestinationPass<'a, 'p> {
    inp: Inputs<'a, 'p>,
    lse: &'a [f32],
    grad_out: &'a [f32],
    first: usize,
    gs_rows: &'a mut [f32],
    /// The destinations' rows of `scratch`.
    sc_rows: &'a mut [f32],
}

impl Kernel for DestinationPass<'_, '_> {
    type Out = ();
    #[inline(always)]
    fn run(self) {
        let DestinationPass {
            inp,
            lse,
            grad_out,
            first,
            gs_rows,
            sc_rows,
        } = self;
        let Inputs { g, p, x, scores } = inp;
        let hs = p.heads;
        let two_h = 2 * hs;
        let mut s = RowBuffers::default();
        for (i, (gsrow, corr)) in gs_rows
            .chunks_exact_mut(two_h)
            .zip(sc_rows.chunks_exact_mut(hs))
            .enumerate()
        {
            let v = first + i;
            s.load(g, p, v);
            let sd = &scores[v * two_h + hs..v * two_h + two_h];
            let l = &lse[v * hs..v * hs + hs];
            let rs = p.row_stream(v);
            corr.fill(0.0);
            // The kink's side every logit of a head shares (its slope), or 1 when some logit
            // is above the kink.
            s.h1.fill(p.slope);
            for (j, &u) in s.srcs.iter().enumerate() {
                if let Some(&ahead) = s.srcs.get(j + AHEAD) {
                    inp.prefetch_source(ahead);
                }
                let su = &scores[u * two_h..u * two_h + hs];
                for h in 0..hs {
                    let pre = su[h] + sd[h];
                    let a = exp_nonpositive(p.leaky(pre) - l[h]);
                    let (gv, gscale) = p.grad_of(grad_out, v, h);
                    let d = gscale * dot(gv, p.head(x, u, h));
                    let md = p.keep_scale(rs, u, h) * d;
                    corr[h] += a * md;
                    let k = j * hs + h;
                    (s.a[k], s.b[k], s.c[k]) = (a, md, p.leaky_grad(pre));
                    if s.c[k] == 1.0 {
                        s.h1[h] = 1.0;
                    }
                }
            }
            let reference = &s.h1;
            let gd = &mut gsrow[hs..];
            gd.fill(0.0);
            for j in 0..s.srcs.len() {
                for h in 0..hs {
                    let k = j * hs + h;
                    gd[h] += s.a[k] * (s.b[k] - corr[h]) * (s.c[k] - reference[h]);
                }
            }
        }
    }
}

/// Backward pass 2, per source `u >= first`: its feature gradient `sum_v a'_uv g_v` and its
/// source-score gradient, over the destinations that read it (its transposed row) and its
/// self-loop.
struct SourcePass<'a, 'p> {
    inp: Inputs<'a, 'p>,
    lse: &'a [f32],
    grad_out: &'a [f32],
    scratch: &'a [f32],
    first: usize,
    gx_rows: &'a mut [f32],
    gs_rows: &'a mut [f32],
}

impl Kernel for SourcePass<'_, '_> {
    type Out = ();
    #[inline(always)]
    fn run(self) {
        let SourcePass {
            inp,
            lse,
            grad_out,
            scratch,
            first,
            gx_rows,
            gs_rows,
        } = self;
        let Inputs { g, p, x, scores } = inp;
        let (hs, f, c, oc) = (p.heads, p.head_dim, p.in_cols(), p.out_cols());
        let two_h = 2 * hs;
        for (i, (gxrow, gsrow)) in gx_rows
            .chunks_exact_mut(c)
            .zip(gs_rows.chunks_exact_mut(two_h))
            .enumerate()
        {
            let u = first + i;
            gxrow.fill(0.0);
            if u >= g.n_dst {
                gsrow[hs..].fill(0.0);
            }
            let (gsrc, _) = gsrow.split_at_mut(hs);
            gsrc.fill(0.0);
            let su = &scores[u * two_h..u * two_h + hs];
            let readers = g.bwd.row(u);
            let own = (p.self_loops && u < g.n_dst).then_some(u);
            let others = readers
                .iter()
                .map(|&v| v as usize)
                .filter(|&v| !p.self_loops || v != u);
            for (k, v) in others.chain(own).enumerate() {
                if let Some(&ahead) = readers.get(k + AHEAD) {
                    let ahead = ahead as usize;
                    prefetch_row(scores, ahead, two_h, two_h);
                    prefetch_row(grad_out, ahead, oc, oc);
                    prefetch_row(lse, ahead, hs, hs);
                    prefetch_row(scratch, ahead, hs, hs);
                }
                let sd = &scores[v * two_h + hs..v * two_h + two_h];
                let rs = p.row_stream(v);
                for h in 0..hs {
                    let pre = su[h] + sd[h];
                    let a = exp_nonpositive(p.leaky(pre) - lse[v * hs + h]);
                    let m = p.keep_scale(rs, u, h);
                    let (gv, gscale) = p.grad_of(grad_out, v, h);
                    let d = gscale * dot(gv, p.head(x, u, h));
                    gsrc[h] += a * (m * d - scratch[v * hs + h]) * p.leaky_grad(pre);
                    let w = a * m * gscale;
                    for (o, &gvv) in gxrow[h * f..h * f + f].iter_mut().zip(gv) {
                        *o += w * gvv;
                    }
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::exp_nonpositive;

    #[test]
    fn exp_nonpositive_is_within_two_ulp() {
        let mut worst = 0.0f64;
        let mut x = 0.0f32;
        while x > -87.0 {
            let want = (x as f64).exp();
            let got = exp_nonpositive(x) as f64;
            let ulp = (want as f32).abs() as f64 * f32::EPSILON as f64;
            worst = worst.max((got - want).abs() / ulp);
            x -= 0.000_73;
        }
        assert!(worst <= 2.0, "worst error {worst} ulp");
        assert_eq!(exp_nonpositive(0.0), 1.0);
        assert_eq!(exp_nonpositive(-100.0), 0.0);
        assert_eq!(exp_nonpositive(f32::NEG_INFINITY), 0.0);
    }
}
