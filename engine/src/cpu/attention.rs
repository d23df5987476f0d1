//! GAT attention kernels behind `attention_aggregate` / `attention_aggregate_backward`: a
//! forward pass over destination rows, and a backward in two passes (destinations, then
//! sources through the transposed CSR) that recomputes every coefficient from the scores and
//! the saved log-sum-exp instead of storing one per edge and head.

use super::aggregate::CpuGraph;
use super::ROW_CHUNK;
use crate::backend::attention_keep;
use rayon::prelude::*;

/// The constants of one attention call, resolved on the host.
pub(super) struct AttnCall<'a> {
    pub heads: usize,
    pub head_dim: usize,
    pub concat: bool,
    pub slope: f32,
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
    #[inline]
    fn leaky(&self, x: f32) -> f32 {
        if x > 0.0 {
            x
        } else {
            self.slope * x
        }
    }
    #[inline]
    fn leaky_grad(&self, x: f32) -> f32 {
        if x > 0.0 {
            1.0
        } else {
            self.slope
        }
    }
    /// The dropout multiplier of the coefficient of `u -> v` in head `h` (local rows).
    #[inline]
    fn keep_scale(&self, v: usize, u: usize, h: usize) -> f32 {
        match self.drop {
            None => 1.0,
            Some((ids, stream, thr, scale)) => {
                if attention_keep(stream, thr, ids[v], ids[u], h as u32) {
                    scale
                } else {
                    0.0
                }
            }
        }
    }
    /// The gradient of head `h`'s output of destination `v` and its factor (`1 / H` when the
    /// heads are averaged).
    #[inline]
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

/// The sources of destination `v` in attention order: its row without self-loops, then `v`.
fn sources(g: &CpuGraph, v: usize) -> impl Iterator<Item = usize> + '_ {
    g.fwd
        .row(v)
        .iter()
        .map(|&u| u as usize)
        .filter(move |&u| u != v)
        .chain(std::iter::once(v))
}

fn dot(a: &[f32], b: &[f32]) -> f32 {
    let mut s = 0.0f32;
    for (x, y) in a.iter().zip(b) {
        s += x * y;
    }
    s
}

pub(super) fn forward(
    g: &CpuGraph,
    p: &AttnCall<'_>,
    x: &[f32],
    scores: &[f32],
    out: &mut [f32],
    lse: &mut [f32],
) {
    let (hs, f, c, oc) = (p.heads, p.head_dim, p.in_cols(), p.out_cols());
    let two_h = 2 * hs;
    out[..g.n_dst * oc]
        .par_chunks_mut(ROW_CHUNK * oc)
        .zip(lse[..g.n_dst * hs].par_chunks_mut(ROW_CHUNK * hs))
        .enumerate()
        .for_each(|(chunk, (out_rows, lse_rows))| {
            for (i, (orow, lrow)) in out_rows
                .chunks_exact_mut(oc)
                .zip(lse_rows.chunks_exact_mut(hs))
                .enumerate()
            {
                let v = chunk * ROW_CHUNK + i;
                orow.fill(0.0);
                for h in 0..hs {
                    let sd = scores[v * two_h + hs + h];
                    let e = |u: usize| p.leaky(scores[u * two_h + h] + sd);
                    let mut max = f32::NEG_INFINITY;
                    for u in sources(g, v) {
                        max = max.max(e(u));
                    }
                    let mut sum = 0.0f32;
                    for u in sources(g, v) {
                        sum += (e(u) - max).exp();
                    }
                    let l = max + sum.ln();
                    lrow[h] = l;
                    let o = if p.concat {
                        &mut orow[h * f..h * f + f]
                    } else {
                        &mut orow[..]
                    };
                    for u in sources(g, v) {
                        let a = (e(u) - l).exp() * p.keep_scale(v, u, h);
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
        });
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
    let (hs, f, c) = (p.heads, p.head_dim, p.in_cols());
    let two_h = 2 * hs;
    // Pass 1, per destination v and head h: c = sum_u a'_u (g_v · x_u), the softmax's
    // correction, kept in `scratch`; and the gradient of v's destination score,
    // sum_u a_u (m_u (g_v · x_u) - c) leaky'(pre_u).
    grad_scores[..g.n_dst * two_h]
        .par_chunks_mut(ROW_CHUNK * two_h)
        .zip(scratch[..g.n_dst * hs].par_chunks_mut(ROW_CHUNK * hs))
        .enumerate()
        .for_each(|(chunk, (gs_rows, sc_rows))| {
            for (i, (gsrow, scrow)) in gs_rows
                .chunks_exact_mut(two_h)
                .zip(sc_rows.chunks_exact_mut(hs))
                .enumerate()
            {
                let v = chunk * ROW_CHUNK + i;
                for h in 0..hs {
                    let l = lse[v * hs + h];
                    let sd = scores[v * two_h + hs + h];
                    let (gv, gscale) = p.grad_of(grad_out, v, h);
                    let term = |u: usize| {
                        let pre = scores[u * two_h + h] + sd;
                        let a = (p.leaky(pre) - l).exp();
                        let d = gscale * dot(gv, &x[u * c + h * f..u * c + h * f + f]);
                        (pre, a, p.keep_scale(v, u, h), d)
                    };
                    let mut corr = 0.0f32;
                    for u in sources(g, v) {
                        let (_, a, m, d) = term(u);
                        corr += a * m * d;
                    }
                    let mut gd = 0.0f32;
                    for u in sources(g, v) {
                        let (pre, a, m, d) = term(u);
                        gd += a * (m * d - corr) * p.leaky_grad(pre);
                    }
                    scrow[h] = corr;
                    gsrow[hs + h] = gd;
                }
            }
        });
    let scratch = &*scratch;
    // Pass 2, per source u: its feature gradient sum_v a'_uv g_v and its source-score
    // gradient, over the destinations that read it (the transposed row) and its self-loop.
    grad_x[..g.n_src * c]
        .par_chunks_mut(ROW_CHUNK * c)
        .zip(grad_scores[..g.n_src * two_h].par_chunks_mut(ROW_CHUNK * two_h))
        .enumerate()
        .for_each(|(chunk, (gx_rows, gs_rows))| {
            for (i, (gxrow, gsrow)) in gx_rows
                .chunks_exact_mut(c)
                .zip(gs_rows.chunks_exact_mut(two_h))
                .enumerate()
            {
                let u = chunk * ROW_CHUNK + i;
                gxrow.fill(0.0);
                if u >= g.n_dst {
                    gsrow[hs..].fill(0.0);
                }
                let own = (u < g.n_dst).then_some(u);
                let readers = || {
                    let others = g.bwd.row(u).iter().map(|&v| v as usize);
                    others.filter(move |&v| v != u).chain(own)
                };
                for h in 0..hs {
                    let su = scores[u * two_h + h];
                    let xu = &x[u * c + h * f..u * c + h * f + f];
                    let gx = &mut gxrow[h * f..h * f + f];
                    let mut gsum = 0.0f32;
                    for v in readers() {
                        let pre = su + scores[v * two_h + hs + h];
                        let a = (p.leaky(pre) - lse[v * hs + h]).exp();
                        let m = p.keep_scale(v, u, h);
                        let (gv, gscale) = p.grad_of(grad_out, v, h);
                        let d = gscale * dot(gv, xu);
                        gsum += a * (m * d - scratch[v * hs + h]) * p.leaky_grad(pre);
                        let w = a * m * gscale;
                        for (o, &gvv) in gx.iter_mut().zip(gv) {
                            *o += w * gvv;
                        }
                    }
                    gsrow[h] = gsum;
                }
            }
        });
}
