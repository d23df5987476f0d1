//! Every backward of the CPU backend against central finite differences (in f64 around the
//! f32 kernels, small sizes), plus block-vs-full aggregation and mask invariance.

mod common;

use common::{cpu, random_graph, rnd};
use grandis_engine::norm::{full_block, global_scales, sub_block, Aggregation};
use grandis_engine::{AdamStep, Backend, CpuBackend, DropoutKey, Kernels};
use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;

fn dot(a: &[f32], b: &[f32]) -> f64 {
    a.iter().zip(b).map(|(&x, &y)| x as f64 * y as f64).sum()
}

/// Checks `analytic` (d f / d x) against central differences of `f` at `x`.
fn fd_check(name: &str, x: &[f32], analytic: &[f32], f: impl Fn(&[f32]) -> f64) {
    fd_check_eps(name, x, analytic, 1e-2, f)
}

/// [`fd_check`] with step `eps` (a smaller one for functions with kinks, like LeakyReLU).
fn fd_check_eps(name: &str, x: &[f32], analytic: &[f32], eps: f32, f: impl Fn(&[f32]) -> f64) {
    let mut worst = 0.0f64;
    for i in 0..x.len() {
        let mut xp = x.to_vec();
        xp[i] += eps;
        let mut xm = x.to_vec();
        xm[i] -= eps;
        let num = (f(&xp) - f(&xm)) / (2.0 * eps as f64);
        let err =
            (num - analytic[i] as f64).abs() / (1e-2 + num.abs().max(analytic[i].abs() as f64));
        worst = worst.max(err);
        assert!(
            err < 2e-2,
            "{name}: element {i}: finite difference {num}, analytic {}",
            analytic[i]
        );
    }
    eprintln!("{name}: worst relative error {worst:.2e}");
}

#[test]
fn gemm_all_transposes_match_naive() {
    let b = cpu();
    let (m, n, k) = (7, 5, 9);
    for ta in [false, true] {
        for tb in [false, true] {
            let a = rnd(m * k, 1);
            let bb = rnd(k * n, 2);
            let mut c = rnd(m * n, 3);
            let c0 = c.clone();
            b.gemm(ta, tb, m, n, k, 0.5, &a, &bb, 2.0, &mut c).unwrap();
            for i in 0..m {
                for j in 0..n {
                    let mut s = 0.0f64;
                    for p in 0..k {
                        let av = if ta { a[p * m + i] } else { a[i * k + p] };
                        let bv = if tb { bb[j * k + p] } else { bb[p * n + j] };
                        s += av as f64 * bv as f64;
                    }
                    let want = 0.5 * s + 2.0 * c0[i * n + j] as f64;
                    assert!((c[i * n + j] as f64 - want).abs() < 1e-4, "ta={ta} tb={tb}");
                }
            }
        }
    }
}

#[test]
fn gemm_long_k_split_is_exact_enough_and_thread_independent() {
    // k large enough to take the chunked-reduction path.
    let (m, n, k) = (6, 4, 40_000);
    let a = rnd(k * m, 4);
    let g = rnd(k * n, 5);
    let run = |threads| {
        let b = CpuBackend::new(Some(threads)).unwrap();
        let mut c = vec![f32::NAN; m * n];
        b.gemm(true, false, m, n, k, 1.0, &a, &g, 0.0, &mut c)
            .unwrap();
        c
    };
    let c1 = run(1);
    let c2 = run(2);
    assert_eq!(
        c1, c2,
        "chunked reduction must not depend on the thread count"
    );
    for i in 0..m {
        for j in 0..n {
            let s: f64 = (0..k)
                .map(|p| a[p * m + i] as f64 * g[p * n + j] as f64)
                .sum();
            assert!((c1[i * n + j] as f64 - s).abs() < 1e-2 * (1.0 + s.abs()));
        }
    }
}

#[test]
fn gemm_rejects_short_buffers() {
    let b = cpu();
    let mut c = vec![0.0; 3];
    let err = b
        .gemm(
            false,
            false,
            2,
            2,
            2,
            1.0,
            &vec![0.0; 4],
            &vec![0.0; 4],
            0.0,
            &mut c,
        )
        .unwrap_err();
    assert!(err.to_string().contains("gemm"), "{err}");
}

#[test]
fn aggregation_backward_matches_finite_differences_for_every_norm() {
    let b = cpu();
    let g = random_graph(12, 40, 7);
    for agg in [Aggregation::Mean, Aggregation::Sum, Aggregation::Gcn] {
        let block = full_block(g.view(), agg);
        let up = b.upload_graph(&block).unwrap();
        let d = 3;
        let x = rnd(12 * d, 8);
        let r = rnd(12 * d, 9);
        let f = |x: &[f32]| {
            let mut out = vec![0.0; 12 * d];
            b.aggregate(&up, &x.to_vec(), d, &mut out).unwrap();
            dot(&out, &r)
        };
        let mut gx = vec![f32::NAN; 12 * d];
        b.aggregate_backward(&up, &r, d, &mut gx).unwrap();
        fd_check(&format!("aggregate {agg:?}"), &x, &gx, f);
    }
}

#[test]
fn gcn_normalisation_matches_dense_formula() {
    let b = cpu();
    let g = random_graph(9, 25, 11);
    let block = full_block(g.view(), Aggregation::Gcn);
    let up = b.upload_graph(&block).unwrap();
    let x = rnd(9, 12);
    let mut out = vec![0.0; 9];
    b.aggregate(&up, &x, 1, &mut out).unwrap();
    // Dense A + I (a row that already has its loop keeps it once).
    let mut a = vec![[0.0f64; 9]; 9];
    for v in 0..9u32 {
        for &u in g.view().neighbors(v) {
            a[v as usize][u as usize] = 1.0;
        }
        a[v as usize][v as usize] = 1.0;
    }
    let deg: Vec<f64> = a.iter().map(|r| r.iter().sum()).collect();
    for v in 0..9 {
        let want: f64 = (0..9)
            .map(|u| a[v][u] * x[u] as f64 / (deg[v] * deg[u]).sqrt())
            .sum();
        assert!(
            (out[v] as f64 - want).abs() < 1e-5,
            "row {v}: {} vs {want}",
            out[v]
        );
    }
}

#[test]
fn block_aggregation_equals_full_graph_rows() {
    let b = cpu();
    let g = random_graph(30, 150, 13);
    for agg in [Aggregation::Mean, Aggregation::Gcn] {
        let d = 4;
        let x = rnd(30 * d, 14);
        let full = b.upload_graph(&full_block(g.view(), agg)).unwrap();
        let mut want = vec![0.0; 30 * d];
        b.aggregate(&full, &x, d, &mut want).unwrap();
        // This "device" owns every third vertex; halo = everything its rows read.
        let (dst, src, blk) = common::every_third_block(&g, agg);
        let up = b.upload_graph(&blk).unwrap();
        let xs: Vec<f32> = src
            .iter()
            .flat_map(|&u| x[u as usize * d..(u as usize + 1) * d].to_vec())
            .collect();
        let mut out = vec![0.0; dst.len() * d];
        b.aggregate(&up, &xs, d, &mut out).unwrap();
        for (i, &v) in dst.iter().enumerate() {
            assert_eq!(
                &out[i * d..(i + 1) * d],
                &want[v as usize * d..(v as usize + 1) * d],
                "{agg:?} row {v}"
            );
        }
        // Backward: the block's halo gradients, summed into global rows, plus the other
        // blocks' contributions, equal the full backward; here we check the adjoint identity.
        let r = rnd(dst.len() * d, 15);
        let mut gx = vec![0.0; src.len() * d];
        b.aggregate_backward(&up, &r, d, &mut gx).unwrap();
        assert!((dot(&out, &r) - dot(&xs, &gx)).abs() < 1e-4);
    }
}

#[test]
fn upload_graph_rejects_bad_blocks() {
    let b = cpu();
    let mut blk = full_block(random_graph(5, 10, 1).view(), Aggregation::Mean);
    blk.indices[0] = 99;
    assert!(b.upload_graph(&blk).is_err());
    let mut blk = full_block(random_graph(5, 10, 1).view(), Aggregation::Mean);
    blk.dst_scale.pop();
    assert!(b.upload_graph(&blk).is_err());
}

#[test]
fn relu_dropout_backward_match_finite_differences() {
    let b = cpu();
    let (rows, cols) = (5, 6);
    let x: Vec<f32> = rnd(rows * cols, 20)
        .into_iter()
        .map(|v| if v.abs() < 0.05 { 0.3 } else { v })
        .collect();
    let r = rnd(rows * cols, 21);
    let f = |x: &[f32]| {
        let mut y = vec![0.0; rows * cols];
        b.relu(&x.to_vec(), &mut y, rows * cols).unwrap();
        dot(&y, &r)
    };
    let mut y = vec![0.0; rows * cols];
    b.relu(&x, &mut y, rows * cols).unwrap();
    let mut g = r.clone();
    b.relu_backward(&y, &mut g, rows * cols).unwrap();
    fd_check("relu", &x, &g, f);

    let ids: Vec<u32> = (100..100 + rows as u32).collect();
    let key = DropoutKey {
        seed: 3,
        epoch: 2,
        layer: 1,
    };
    let f = |x: &[f32]| {
        let mut y = vec![0.0; rows * cols];
        b.dropout(&x.to_vec(), &mut y, rows, cols, &ids, 0.4, key)
            .unwrap();
        dot(&y, &r)
    };
    let mut g = r.clone();
    b.dropout_backward(&mut g, rows, cols, &ids, 0.4, key)
        .unwrap();
    fd_check("dropout", &x, &g, f);
}

/// The fused bias and ReLU is the two passes it replaces, bit for bit, and leaves its input
/// alone; short buffers are shape errors.
#[test]
fn bias_relu_is_add_bias_then_relu() {
    let b = cpu();
    for (rows, cols) in [(1usize, 1usize), (7, 5), (3000, 64)] {
        let y = rnd(rows * cols, 21);
        let bias = rnd(cols, 22);
        let mut want = y.clone();
        b.add_bias(&mut want, &bias, rows, cols).unwrap();
        let mut relu = vec![0.0; rows * cols];
        b.relu(&want, &mut relu, rows * cols).unwrap();
        let mut out = vec![f32::NAN; rows * cols];
        b.bias_relu(&y, &bias, &mut out, rows, cols).unwrap();
        assert!(relu
            .iter()
            .zip(&out)
            .all(|(a, c)| a.to_bits() == c.to_bits()));
        assert_eq!(y, rnd(rows * cols, 21));
    }
    let mut out = vec![0.0; 4];
    assert!(b
        .bias_relu(&vec![0.0; 3], &vec![0.0; 2], &mut out, 2, 2)
        .is_err());
    assert!(b
        .bias_relu(&vec![0.0; 4], &vec![0.0; 1], &mut out, 2, 2)
        .is_err());
}

#[test]
fn dropout_mask_depends_on_global_id_not_position() {
    let b = cpu();
    let cols = 64;
    let key = DropoutKey {
        seed: 9,
        epoch: 4,
        layer: 2,
    };
    let ids: Vec<u32> = (0..50).collect();
    let x = vec![1.0f32; 50 * cols];
    let mut all = vec![0.0; 50 * cols];
    b.dropout(&x, &mut all, 50, cols, &ids, 0.5, key).unwrap();
    // The same vertices in another order (another partition) draw the same masks.
    let perm: Vec<u32> = (0..50).rev().step_by(3).collect();
    let mut part = vec![0.0; perm.len() * cols];
    b.dropout(&x, &mut part, perm.len(), cols, &perm, 0.5, key)
        .unwrap();
    for (i, &v) in perm.iter().enumerate() {
        assert_eq!(
            &part[i * cols..(i + 1) * cols],
            &all[v as usize * cols..(v as usize + 1) * cols]
        );
    }
    let kept = all.iter().filter(|&&v| v != 0.0).count() as f64 / all.len() as f64;
    assert!((kept - 0.5).abs() < 0.05, "kept fraction {kept}");
    assert!(all.iter().all(|&v| v == 0.0 || v == 2.0));
    // Another epoch draws another mask.
    let mut other = vec![0.0; 50 * cols];
    b.dropout(
        &x,
        &mut other,
        50,
        cols,
        &ids,
        0.5,
        DropoutKey { epoch: 5, ..key },
    )
    .unwrap();
    assert_ne!(all, other);
}

#[test]
fn layer_norm_backward_matches_finite_differences() {
    let b = cpu();
    let (rows, cols) = (4, 7);
    let x = rnd(rows * cols, 30);
    let gamma: Vec<f32> = rnd(cols, 31).iter().map(|v| 1.0 + 0.5 * v).collect();
    let beta = rnd(cols, 32);
    let r = rnd(rows * cols, 33);
    let run = |x: &[f32], gamma: &[f32], beta: &[f32]| {
        let mut out = vec![0.0; rows * cols];
        let (mut m, mut s) = (vec![0.0; rows], vec![0.0; rows]);
        b.layer_norm(
            &x.to_vec(),
            &gamma.to_vec(),
            &beta.to_vec(),
            rows,
            cols,
            1e-5,
            &mut out,
            &mut m,
            &mut s,
        )
        .unwrap();
        (out, m, s)
    };
    let (_, m, s) = run(&x, &gamma, &beta);
    let mut gx = vec![0.0; rows * cols];
    let mut gg = vec![0.0; cols];
    let mut gb = vec![0.0; cols];
    b.layer_norm_backward(
        &r, &x, &gamma, &m, &s, rows, cols, &mut gx, &mut gg, &mut gb,
    )
    .unwrap();
    fd_check("layer_norm x", &x, &gx, |x| {
        dot(&run(x, &gamma, &beta).0, &r)
    });
    fd_check("layer_norm gamma", &gamma, &gg, |g| {
        dot(&run(&x, g, &beta).0, &r)
    });
    fd_check("layer_norm beta", &beta, &gb, |bt| {
        dot(&run(&x, &gamma, bt).0, &r)
    });
}

#[test]
fn cross_entropy_gradient_matches_finite_differences() {
    let b = cpu();
    let (n, c) = (6, 4);
    let logits: Vec<f32> = rnd(n * c, 40).iter().map(|v| 2.0 * v).collect();
    let rows = vec![0u32, 2, 5];
    let labels = vec![3u32, 0, 1];
    let loss = |z: &[f32]| {
        let mut g = vec![0.0; n * c];
        b.cross_entropy(&z.to_vec(), n, c, &rows, &labels, 10.0, &mut g)
            .unwrap()
            / 10.0
    };
    let mut g = vec![f32::NAN; n * c];
    let total = b
        .cross_entropy(&logits, n, c, &rows, &labels, 10.0, &mut g)
        .unwrap();
    assert!(total > 0.0);
    fd_check("cross_entropy", &logits, &g, loss);
    assert!(
        g[c..2 * c].iter().all(|&v| v == 0.0),
        "unselected rows get zero gradient"
    );
    assert!(b
        .cross_entropy(&logits, n, c, &rows, &vec![0, 9, 0], 10.0, &mut g)
        .is_err());
}

#[test]
fn bias_and_gemm_weight_gradients_match_finite_differences() {
    let b = cpu();
    let (rows, din, dout) = (5, 3, 4);
    let x = rnd(rows * din, 50);
    let w = rnd(din * dout, 51);
    let bias = rnd(dout, 52);
    let r = rnd(rows * dout, 53);
    let fwd = |x: &[f32], w: &[f32], bias: &[f32]| {
        let mut y = vec![0.0; rows * dout];
        b.gemm(
            false,
            false,
            rows,
            dout,
            din,
            1.0,
            &x.to_vec(),
            &w.to_vec(),
            0.0,
            &mut y,
        )
        .unwrap();
        b.add_bias(&mut y, &bias.to_vec(), rows, dout).unwrap();
        dot(&y, &r)
    };
    let mut gw = vec![0.0; din * dout];
    b.gemm(true, false, din, dout, rows, 1.0, &x, &r, 0.0, &mut gw)
        .unwrap();
    let mut gx = vec![0.0; rows * din];
    b.gemm(false, true, rows, din, dout, 1.0, &r, &w, 0.0, &mut gx)
        .unwrap();
    let mut gb = vec![0.0; dout];
    b.col_sum(&r, rows, dout, 0.0, &mut gb).unwrap();
    fd_check("linear x", &x, &gx, |x| fwd(x, &w, &bias));
    fd_check("linear w", &w, &gw, |w| fwd(&x, w, &bias));
    fd_check("linear bias", &bias, &gb, |bb| fwd(&x, &w, bb));
}

#[test]
fn adam_and_adamw_follow_the_documented_formula() {
    let b = cpu();
    for decoupled in [false, true] {
        let mut w = vec![1.0f32, -2.0];
        let g = vec![0.5f32, 0.25];
        let (mut m, mut v) = (vec![0.0; 2], vec![0.0; 2]);
        let step = AdamStep {
            weight_decay: 0.01,
            decoupled,
            ..AdamStep::new(0.1, 1)
        };
        b.adam_step(&mut w, &g, &mut m, &mut v, 2, &step).unwrap();
        for (i, w0) in [1.0f64, -2.0].into_iter().enumerate() {
            let gi = g[i] as f64 + if decoupled { 0.0 } else { 0.01 * w0 };
            // First step: m_hat = g, v_hat = g^2, so the update is lr * sign(g).
            let mut want = w0;
            if decoupled {
                want -= 0.1 * 0.01 * w0;
            }
            want -= 0.1 * gi / (gi.abs() + 1e-8);
            assert!((w[i] as f64 - want).abs() < 1e-5, "decoupled={decoupled}");
        }
    }
    let ss = b.sum_squares(&vec![3.0, 4.0], 2).unwrap();
    assert_eq!(ss, 25.0);
}

#[test]
fn gather_and_scatter_rows() {
    let b = cpu();
    let src: Vec<f32> = (0..12).map(|v| v as f32).collect();
    let mut out = vec![0.0; 6];
    b.gather_rows(&src, 2, &vec![5, 0, 5], &mut out).unwrap();
    assert_eq!(out, vec![10.0, 11.0, 0.0, 1.0, 10.0, 11.0]);
    let mut acc = vec![0.0; 12];
    b.scatter_add_rows(&out, 2, &vec![1, 1, 0], &mut acc)
        .unwrap();
    assert_eq!(&acc[..4], &[10.0, 11.0, 10.0, 12.0]);
    assert!(b.gather_rows(&src, 2, &vec![6], &mut out).is_err());
}

#[test]
fn aggregation_matches_naive_for_every_column_blocking() {
    // Widths that exercise the 32/16/8/1-column register blocks and their combinations.
    let b = cpu();
    let g = random_graph(40, 300, 17);
    for agg in [Aggregation::Mean, Aggregation::Gcn] {
        let block = full_block(g.view(), agg);
        let up = b.upload_graph(&block).unwrap();
        for d in [1usize, 7, 8, 16, 24, 37, 64, 77] {
            let x = rnd(40 * d, d as u64);
            let mut out = vec![f32::NAN; 40 * d];
            b.aggregate(&up, &x, d, &mut out).unwrap();
            for v in 0..40usize {
                for c in 0..d {
                    let mut acc = 0.0f64;
                    for &u in g.view().neighbors(v as u32) {
                        let s = block.src_scale.as_ref().map_or(1.0, |s| s[u as usize]);
                        acc += s as f64 * x[u as usize * d + c] as f64;
                    }
                    let mut want = block.dst_scale[v] as f64 * acc;
                    if let Some(sl) = &block.self_scale {
                        want += sl[v] as f64 * x[v * d + c] as f64;
                    }
                    let got = out[v * d + c] as f64;
                    assert!((got - want).abs() < 1e-5, "{agg:?} d={d} v={v} c={c}");
                }
            }
        }
    }
}

#[test]
fn dropout_kernel_follows_the_documented_hash() {
    let b = cpu();
    let key = DropoutKey {
        seed: 123,
        epoch: 7,
        layer: 3,
    };
    let (rows, cols) = (300, 37);
    let ids: Vec<u32> = (0..rows as u32).map(|r| r * 7919 + 11).collect();
    let x = rnd(rows * cols, 99);
    let mut out = vec![0.0; rows * cols];
    b.dropout(&x, &mut out, rows, cols, &ids, 0.3, key).unwrap();
    let (stream, thr) = (key.stream(), grandis_engine::dropout_threshold(0.3));
    for r in 0..rows {
        for c in 0..cols {
            let keep = grandis_engine::dropout_keep(stream, thr, ids[r], c as u32);
            // Kept values are multiplied by the f32 factor 1 / (1 - p), as documented.
            let want = if keep {
                x[r * cols + c] * (1.0f32 / (1.0 - 0.3f32))
            } else {
                0.0
            };
            assert_eq!(out[r * cols + c], want, "row {r} col {c}");
        }
    }
}

#[test]
fn tall_skinny_gemm_matches_naive() {
    // m large enough for the register-blocked tall-skinny kernel; odd widths for the tails.
    let b = cpu();
    for (m, n, k) in [
        (1500usize, 64usize, 128usize),
        (1201, 37, 5),
        (1030, 16, 64),
        (1100, 3, 9),
    ] {
        for tb in [false, true] {
            let a = rnd(m * k, 61);
            let bb = rnd(k * n, 62);
            let mut c = rnd(m * n, 63);
            let c0 = c.clone();
            b.gemm(false, tb, m, n, k, 1.5, &a, &bb, 0.5, &mut c)
                .unwrap();
            for i in (0..m).step_by(7) {
                for j in 0..n {
                    let s: f64 = (0..k)
                        .map(|p| {
                            let bv = if tb { bb[j * k + p] } else { bb[p * n + j] };
                            a[i * k + p] as f64 * bv as f64
                        })
                        .sum();
                    let want = 1.5 * s + 0.5 * c0[i * n + j] as f64;
                    assert!(
                        (c[i * n + j] as f64 - want).abs() < 1e-3,
                        "m={m} n={n} k={k} tb={tb} ({i},{j})"
                    );
                }
            }
        }
    }
}

// ---- GAT attention ---------------------------------------------------------------------

use grandis_engine::{attention_keep, dropout_threshold, Attention, AttentionDropout, BlockGraph};

/// A block of `n_dst` destinations over `n_src` sources whose rows hold self-loops,
/// repeated edges and empty rows (what `attention_aggregate` must handle).
fn attention_block(n_dst: usize, n_src: usize, seed: u64) -> BlockGraph {
    let mut r = ChaCha8Rng::seed_from_u64(seed);
    let mut offsets = vec![0u64];
    let mut indices = Vec::new();
    for v in 0..n_dst {
        let deg = if v % 5 == 4 { 0 } else { r.gen_range(1..6) };
        for _ in 0..deg {
            indices.push(r.gen_range(0..n_src as u32));
        }
        if v % 3 == 0 {
            indices.push(v as u32);
            indices.push(indices[indices.len() - 2.min(indices.len())]);
        }
        offsets.push(indices.len() as u64);
    }
    BlockGraph {
        n_dst,
        n_src,
        offsets,
        indices,
        dst_scale: vec![1.0; n_dst],
        src_scale: None,
        self_scale: None,
    }
}

/// `attention_aggregate` in f64 straight from its documented formula.
#[allow(clippy::too_many_arguments)]
fn naive_attention(
    blk: &BlockGraph,
    x: &[f32],
    scores: &[f32],
    heads: usize,
    f: usize,
    concat: bool,
    self_loops: bool,
    keep: &dyn Fn(usize, usize, usize) -> f64,
) -> Vec<f64> {
    let c = heads * f;
    let oc = if concat { c } else { f };
    let mut out = vec![0.0f64; blk.n_dst * oc];
    for v in 0..blk.n_dst {
        let row = &blk.indices[blk.offsets[v] as usize..blk.offsets[v + 1] as usize];
        let mut srcs: Vec<usize> = row
            .iter()
            .map(|&u| u as usize)
            .filter(|&u| !self_loops || u != v)
            .collect();
        if self_loops {
            srcs.push(v);
        }
        for h in 0..heads {
            let e: Vec<f64> = srcs
                .iter()
                .map(|&u| {
                    let pre =
                        scores[u * 2 * heads + h] as f64 + scores[v * 2 * heads + heads + h] as f64;
                    if pre > 0.0 {
                        pre
                    } else {
                        0.2 * pre
                    }
                })
                .collect();
            let max = e.iter().cloned().fold(f64::NEG_INFINITY, f64::max);
            let z: f64 = e.iter().map(|e| (e - max).exp()).sum();
            for (j, &u) in srcs.iter().enumerate() {
                let a = (e[j] - max).exp() / z * keep(v, u, h);
                for k in 0..f {
                    let o = if concat {
                        v * oc + h * f + k
                    } else {
                        v * oc + k
                    };
                    let w = if concat { 1.0 } else { 1.0 / heads as f64 };
                    out[o] += w * a * x[u * c + h * f + k] as f64;
                }
            }
        }
    }
    out
}

/// The documented dropout factor of coefficient `u -> v` in head `h` under `att` (local rows;
/// 1 without dropout).
fn keep_multiplier<'a>(
    att: &'a Attention<'a, Vec<u32>>,
) -> impl Fn(usize, usize, usize) -> f64 + 'a {
    move |v, u, h| match &att.dropout {
        None => 1.0,
        Some(d) => {
            let (stream, t) = (d.key.stream(), dropout_threshold(d.p));
            let ids = d.global_ids;
            if attention_keep(stream, t, ids[v], ids[u], h as u32) {
                1.0 / (1.0 - d.p as f64)
            } else {
                0.0
            }
        }
    }
}

fn attention<'a>(
    heads: usize,
    f: usize,
    concat: bool,
    drop: Option<(&'a Vec<u32>, f32)>,
) -> Attention<'a, Vec<u32>> {
    Attention {
        heads,
        head_dim: f,
        concat,
        negative_slope: 0.2,
        self_loops: true,
        dropout: drop.map(|(ids, p)| AttentionDropout {
            global_ids: ids,
            p,
            key: DropoutKey {
                seed: 3,
                epoch: 1,
                layer: 7,
            },
        }),
    }
}

#[test]
fn attention_forward_follows_the_documented_formula() {
    let b = cpu();
    let blk = attention_block(40, 55, 21);
    let up = b.upload_graph(&blk).unwrap();
    let ids: Vec<u32> = (0..55u32).map(|i| i * 7 + 3).collect();
    let cases = [(3, 4, true), (3, 4, false), (1, 5, false)];
    for ((heads, f, concat), self_loops) in cases.into_iter().flat_map(|c| [(c, true), (c, false)])
    {
        for p in [None, Some(0.4f32)] {
            let x = rnd(55 * heads * f, 22);
            let scores = rnd(55 * 2 * heads, 23);
            let att = Attention {
                self_loops,
                ..attention(heads, f, concat, p.map(|p| (&ids, p)))
            };
            let mut out = vec![f32::NAN; 40 * att.out_cols()];
            let mut lse = vec![f32::NAN; 40 * heads];
            b.attention_aggregate(&up, &x, &scores, &att, &mut out, &mut lse)
                .unwrap();
            let keep = keep_multiplier(&att);
            let want = naive_attention(&blk, &x, &scores, heads, f, concat, self_loops, &keep);
            for (i, (&o, &w)) in out.iter().zip(&want).enumerate() {
                assert!(
                    (o as f64 - w).abs() < 1e-5,
                    "heads {heads} concat {concat} p {p:?} self-loops {self_loops} [{i}]: {o} vs {w}"
                );
            }
            assert!(lse.iter().all(|l| l.is_finite()), "{lse:?}");
        }
    }
}

#[test]
fn attention_backward_matches_finite_differences() {
    let b = cpu();
    let (n_dst, n_src) = (14, 20);
    let blk = attention_block(n_dst, n_src, 31);
    let up = b.upload_graph(&blk).unwrap();
    let ids: Vec<u32> = (0..n_src as u32).collect();
    for (heads, f, concat, p, self_loops) in [
        (2, 3, true, None, true),
        (2, 3, false, Some(0.3f32), true),
        (3, 2, true, Some(0.3), true),
        (2, 3, true, Some(0.3), false),
        (3, 2, false, None, false),
    ] {
        let att = Attention {
            self_loops,
            ..attention(heads, f, concat, p.map(|p| (&ids, p)))
        };
        let c = heads * f;
        let x = rnd(n_src * c, 32);
        let scores = rnd(n_src * 2 * heads, 33);
        let r = rnd(n_dst * att.out_cols(), 34);
        let mut out = vec![0.0; n_dst * att.out_cols()];
        let mut lse = vec![0.0; n_dst * heads];
        b.attention_aggregate(&up, &x, &scores, &att, &mut out, &mut lse)
            .unwrap();
        let mut gx = vec![f32::NAN; n_src * c];
        let mut gs = vec![f32::NAN; n_src * 2 * heads];
        let mut scratch = vec![f32::NAN; n_dst * heads];
        b.attention_aggregate_backward(
            &up,
            &x,
            &scores,
            &lse,
            &att,
            &r,
            &mut gx,
            &mut gs,
            &mut scratch,
        )
        .unwrap();
        // Differences of the f64 reference: the f32 kernel's rounding would swamp a step small
        // enough to stay off LeakyReLU's kink (this seed has a logit at -3.6e-4).
        let keep = keep_multiplier(&att);
        let loss = |x: &[f32], s: &[f32]| {
            let out = naive_attention(&blk, x, s, heads, f, concat, self_loops, &keep);
            out.iter().zip(&r).map(|(&o, &r)| o * r as f64).sum::<f64>()
        };
        let name =
            format!("attention heads {heads} concat {concat} p {p:?} self-loops {self_loops}");
        fd_check_eps(&format!("{name} x"), &x, &gx, 1e-3, |x| loss(x, &scores));
        fd_check_eps(&format!("{name} scores"), &scores, &gs, 1e-4, |s| {
            loss(&x, s)
        });
    }
}

#[test]
fn attention_on_blocks_adds_up_to_the_full_graph() {
    let b = cpu();
    let n = 36;
    let g = random_graph(n, 200, 41);
    let (heads, f) = (2, 3);
    let c = heads * f;
    let x = rnd(n * c, 42);
    let scores = rnd(n * 2 * heads, 43);
    let all: Vec<u32> = (0..n as u32).collect();
    for concat in [true, false] {
        let att = attention(heads, f, concat, Some((&all, 0.25)));
        let oc = att.out_cols();
        let r = rnd(n * oc, 44);
        let full = b
            .upload_graph(&full_block(g.view(), Aggregation::Mean))
            .unwrap();
        let mut want = vec![0.0; n * oc];
        let mut lse = vec![0.0; n * heads];
        b.attention_aggregate(&full, &x, &scores, &att, &mut want, &mut lse)
            .unwrap();
        let mut want_gx = vec![0.0; n * c];
        let mut want_gs = vec![0.0; n * 2 * heads];
        let mut scratch = vec![0.0; n * heads];
        b.attention_aggregate_backward(
            &full,
            &x,
            &scores,
            &lse,
            &att,
            &r,
            &mut want_gx,
            &mut want_gs,
            &mut scratch,
        )
        .unwrap();
        // Three "devices", each owning every third vertex, with their halos.
        let scales = global_scales(g.view(), Aggregation::Mean);
        let mut gx = vec![0.0f64; n * c];
        let mut gs = vec![0.0f64; n * 2 * heads];
        for part in 0..3 {
            let dst: Vec<u32> = (0..n as u32).filter(|v| v % 3 == part).collect();
            let mut src = dst.clone();
            for &v in &dst {
                for &u in g.view().neighbors(v) {
                    if !src.contains(&u) {
                        src.push(u);
                    }
                }
            }
            let up = b
                .upload_graph(&sub_block(g.view(), &scales, &dst, &src).unwrap())
                .unwrap();
            let rows = |m: &[f32], w: usize, ids: &[u32]| -> Vec<f32> {
                ids.iter()
                    .flat_map(|&u| m[u as usize * w..(u as usize + 1) * w].to_vec())
                    .collect()
            };
            let att = attention(heads, f, concat, Some((&src, 0.25)));
            let (xs, ss, rs) = (
                rows(&x, c, &src),
                rows(&scores, 2 * heads, &src),
                rows(&r, oc, &dst),
            );
            let mut out = vec![0.0; dst.len() * oc];
            let mut lse = vec![0.0; dst.len() * heads];
            b.attention_aggregate(&up, &xs, &ss, &att, &mut out, &mut lse)
                .unwrap();
            assert_eq!(
                out,
                rows(&want, oc, &dst),
                "concat {concat}: block rows equal full rows"
            );
            let mut bgx = vec![0.0; src.len() * c];
            let mut bgs = vec![0.0; src.len() * 2 * heads];
            let mut scratch = vec![0.0; dst.len() * heads];
            b.attention_aggregate_backward(
                &up,
                &xs,
                &ss,
                &lse,
                &att,
                &rs,
                &mut bgx,
                &mut bgs,
                &mut scratch,
            )
            .unwrap();
            for (i, &u) in src.iter().enumerate() {
                let u = u as usize;
                for k in 0..c {
                    gx[u * c + k] += bgx[i * c + k] as f64;
                }
                for k in 0..2 * heads {
                    gs[u * 2 * heads + k] += bgs[i * 2 * heads + k] as f64;
                }
            }
        }
        for (name, got, want) in [("x", &gx, &want_gx), ("scores", &gs, &want_gs)] {
            for (i, (&g, &w)) in got.iter().zip(want.iter()).enumerate() {
                assert!(
                    (g - w as f64).abs() < 1e-5,
                    "concat {concat} grad {name}[{i}]: {g} vs {w}"
                );
            }
        }
    }
}

/// An owned upload holds exactly the host values; the CPU backend keeps plain memory itself
/// (nothing handed back to reuse), as its buffers are host memory.
#[test]
fn owned_upload_keeps_the_values() {
    let b = cpu();
    let host = rnd(37, 9);
    let (buf, back) = b
        .upload_host(grandis_engine::HostBuffer::from_vec(host.clone()))
        .unwrap();
    assert!(back.is_empty());
    let mut out = vec![0f32; host.len()];
    b.download(&buf, 0, &mut out).unwrap();
    assert_eq!(out, host);
}

/// A block checked and transposed ahead (`PreparedGraph`) aggregates forward and backward
/// exactly as the block uploaded directly; a malformed block is refused when prepared.
#[test]
fn prepared_graphs_aggregate_as_uploaded_ones() {
    use grandis_engine::PreparedGraph;
    let b = cpu();
    let g = random_graph(40, 200, 3);
    let blk = full_block(g.view(), Aggregation::Gcn);
    let direct = b.upload_graph(&blk).unwrap();
    let prepared = b
        .upload_prepared(&PreparedGraph::new(blk.clone()).unwrap())
        .unwrap();
    let d = 5;
    let x = rnd(blk.n_src * d, 4);
    let (mut y1, mut y2) = (vec![0f32; blk.n_dst * d], vec![0f32; blk.n_dst * d]);
    b.aggregate(&direct, &x, d, &mut y1).unwrap();
    b.aggregate(&prepared, &x, d, &mut y2).unwrap();
    assert_eq!(y1, y2);
    let go = rnd(blk.n_dst * d, 5);
    let (mut g1, mut g2) = (vec![0f32; blk.n_src * d], vec![0f32; blk.n_src * d]);
    b.aggregate_backward(&direct, &go, d, &mut g1).unwrap();
    b.aggregate_backward(&prepared, &go, d, &mut g2).unwrap();
    assert_eq!(g1, g2);
    let mut bad = blk;
    bad.indices[0] = bad.n_src as u32;
    assert!(PreparedGraph::new(bad).is_err());
}

/// Arguments are checked once, above the backends (`Backend`), before any kernel runs: every
/// operation given a buffer too short, an id out of range, a bad probability or step counter,
/// or sizes whose product overflows returns a shape error naming the operation (never a
/// panic), and leaves its outputs as they were.
#[test]
fn every_operation_refuses_arguments_that_do_not_fit_before_its_kernel_runs() {
    let b = cpu();
    let short = vec![7.0f32; 3];
    let four = vec![1.0f32; 4];
    let ids = vec![0u32, 1];
    let key = DropoutKey {
        seed: 1,
        epoch: 0,
        layer: 0,
    };
    let step = AdamStep::new(0.1, 1);
    let huge = usize::MAX / 2 + 1;
    let mut out = short.clone();
    let mut more = short.clone();
    let mut third = short.clone();
    let refused = |op: &str, r: grandis_engine::Result<()>| {
        let e = r.expect_err(op).to_string();
        assert!(e.starts_with(op), "{op}: {e}");
    };
    refused("upload_into", b.upload_into(&mut out, 2, &[1.0, 2.0]));
    refused("download", b.download(&short, usize::MAX, &mut [0.0]));
    refused("fill", b.fill(&mut out, 4, 0.0));
    refused("copy", b.copy_range(&four, 2, &mut out, 0, 3));
    refused("gather_rows", b.gather_rows(&four, 2, &vec![2], &mut out));
    refused("gather_rows", b.gather_rows(&four, 2, &ids, &mut out));
    refused(
        "scatter_add_rows",
        b.scatter_add_rows(&four, 2, &vec![0, 1], &mut out),
    );
    refused(
        "gemm",
        b.gemm(false, false, 2, 2, 1, 1.0, &four, &four, 0.0, &mut out),
    );
    refused(
        "gemm",
        b.gemm(false, false, huge, 2, 1, 1.0, &four, &four, 0.0, &mut out),
    );
    refused("add_bias", b.add_bias(&mut out, &four, 2, 2));
    refused("add_bias", b.add_bias(&mut out, &four, huge, 2));
    refused("col_sum", b.col_sum(&four, 2, 2, 0.0, &mut vec![0.0; 1]));
    refused("relu", b.relu(&four, &mut out, 4));
    refused("relu_backward", b.relu_backward(&four, &mut out, 4));
    refused("dropout", b.dropout(&four, &mut out, 2, 2, &ids, 0.5, key));
    refused(
        "dropout",
        b.dropout(&four, &mut four.clone(), 2, 2, &ids, 1.0, key),
    );
    refused(
        "dropout_backward",
        b.dropout_backward(&mut out, 2, 2, &ids, 0.5, key),
    );
    refused("axpy", b.axpy(1.0, &four, &mut out, 4));
    refused("scale", b.scale(&mut out, 2.0, 4));
    refused(
        "layer_norm",
        b.layer_norm(
            &four, &four, &four, 2, 2, 1e-5, &mut out, &mut more, &mut third,
        ),
    );
    let (mut p, mut m, mut v) = (short.clone(), short.clone(), short.clone());
    refused(
        "adam_step",
        b.adam_step(&mut p, &four, &mut m, &mut v, 4, &step),
    );
    let zeroth = AdamStep { step: 0, ..step };
    let mut p4 = four.clone();
    let (mut m4, mut v4) = (four.clone(), four.clone());
    refused(
        "adam_step",
        b.adam_step(&mut p4, &four, &mut m4, &mut v4, 4, &zeroth),
    );
    let xent = b.cross_entropy(&four, 2, 2, &ids, &vec![0, 2], 1.0, &mut four.clone());
    assert!(xent
        .expect_err("label 2 of 2 classes")
        .to_string()
        .starts_with("cross_entropy"));
    let xent = b.cross_entropy(&four, 2, 2, &vec![0, 2], &ids, 1.0, &mut four.clone());
    assert!(xent
        .expect_err("row 2 of 2")
        .to_string()
        .starts_with("cross_entropy"));
    assert!(b.sum_squares(&short, 4).is_err());
    // Nothing ran: the outputs hold what they held.
    for buf in [&out, &more, &third, &p, &m, &v] {
        assert_eq!(buf, &short);
    }
    assert_eq!((p4, m4, v4), (four.clone(), four.clone(), four));
}
