//! Element-wise and row-wise kernels: ReLU, counter-based dropout masks, LayerNorm, cross-entropy loss and the Adam/AdamW update.

use super::simd::Simd;
use super::{ordered_partials, ELEM_CHUNK, RED_CHUNK, ROW_CHUNK};
use crate::args::AdamStep;
use rayon::prelude::*;

/// The dropout mask of one call, applied to rows in a vectorisable loop (the hash is the one
/// of [`crate::args::dropout_keep`], evaluated with `stream ^ (gid << 32)` hoisted out of the column loop).
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
                        let h = crate::args::mix64(base ^ j as u64);
                        let keep = (h >> 40) as u32 >= self.thr;
                        o[j] = if keep { i[j] * self.scale } else { 0.0 };
                    }
                }
                None => {
                    for v in o.iter_mut().enumerate() {
                        let (j, v) = v;
                        let h = crate::args::mix64(base ^ j as u64);
                        let keep = (h >> 40) as u32 >= self.thr;
                        *v = if keep { *v * self.scale } else { 0.0 };
                    }
                }
            }
        }
    }
}

pub(super) fn relu(x: &[f32], out: &mut [f32], len: usize) {
    out[..len]
        .par_chunks_mut(ELEM_CHUNK)
        .zip(x[..len].par_chunks(ELEM_CHUNK))
        .for_each(|(o, i)| {
            for (a, &b) in o.iter_mut().zip(i) {
                *a = b.max(0.0);
            }
        })
}

pub(super) fn relu_backward(y: &[f32], grad: &mut [f32], len: usize) {
    grad[..len]
        .par_chunks_mut(ELEM_CHUNK)
        .zip(y[..len].par_chunks(ELEM_CHUNK))
        .for_each(|(g, y)| {
            for (a, &b) in g.iter_mut().zip(y) {
                *a = if b > 0.0 { *a } else { 0.0 };
            }
        })
}

#[allow(clippy::too_many_arguments)]
pub(super) fn dropout(
    x: &[f32],
    out: &mut [f32],
    rows: usize,
    cols: usize,
    global_ids: &[u32],
    stream: u64,
    thr: u32,
    scale: f32,
    level: Simd,
) {
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
}

#[allow(clippy::too_many_arguments)]
pub(super) fn dropout_backward(
    grad: &mut [f32],
    rows: usize,
    cols: usize,
    global_ids: &[u32],
    stream: u64,
    thr: u32,
    scale: f32,
    level: Simd,
) {
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
}

#[allow(clippy::too_many_arguments)]
pub(super) fn layer_norm(
    x: &[f32],
    gamma: &[f32],
    beta: &[f32],
    rows: usize,
    cols: usize,
    eps: f32,
    out: &mut [f32],
    mean: &mut [f32],
    rstd: &mut [f32],
) {
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
}

#[allow(clippy::too_many_arguments)]
pub(super) fn layer_norm_backward(
    grad_out: &[f32],
    x: &[f32],
    gamma: &[f32],
    mean: &[f32],
    rstd: &[f32],
    rows: usize,
    cols: usize,
    grad_x: &mut [f32],
    grad_gamma: &mut [f32],
    grad_beta: &mut [f32],
) {
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
}

pub(super) fn cross_entropy(
    logits: &[f32],
    n: usize,
    classes: usize,
    rows: &[u32],
    labels: &[u32],
    normalizer: f32,
    grad: &mut [f32],
) -> f64 {
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
}

#[allow(clippy::too_many_arguments)]
pub(super) fn adam_step(
    param: &mut [f32],
    grad: &[f32],
    m: &mut [f32],
    v: &mut [f32],
    len: usize,
    s: &AdamStep,
    bc1: f32,
    bc2: f32,
) {
    param[..len]
        .par_chunks_mut(ELEM_CHUNK)
        .zip(grad[..len].par_chunks(ELEM_CHUNK))
        .zip(m[..len].par_chunks_mut(ELEM_CHUNK))
        .zip(v[..len].par_chunks_mut(ELEM_CHUNK))
        .for_each(|(((w, g), m), v)| s.apply_corrected(w, g, m, v, bc1, bc2))
}
