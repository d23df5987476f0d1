//! Dense GEMM kernels: the deterministic split-k product, the register-blocked tall-skinny kernel, and row-parallel `matrixmultiply` calls.

use super::simd::{simd_level, Simd};
use super::{RED_CHUNK, ROW_CHUNK};
use crate::kernels::GemmShape;
use rayon::prelude::*;

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

/// One matrixmultiply call on a row range of C. `a` points at the start of A, `rows` are the
/// rows of C (and of op(A)) to compute.
fn sgemm_rows(
    shape: GemmShape,
    rows: std::ops::Range<usize>,
    a: &[f32],
    b: &[f32],
    c_rows: &mut [f32],
) {
    let GemmShape {
        trans_a,
        trans_b,
        m: m_total,
        n,
        k,
        alpha,
        beta,
    } = shape;
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

/// The body of [`crate::Backend::gemm`] for `CpuBackend` (arguments already checked).
pub(super) fn gemm(shape: GemmShape, a: &[f32], b: &[f32], c: &mut [f32]) {
    let GemmShape {
        trans_a,
        trans_b,
        m,
        n,
        k,
        alpha,
        beta,
    } = shape;
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
                sgemm_rows(shape, r0..r1, a, b, c_rows);
            });
    }
}
