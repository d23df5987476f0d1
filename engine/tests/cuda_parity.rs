//! CPU/GPU parity of every `Backend` operation: the same inputs through `CpuBackend` and
//! `CudaBackend` must agree within 1e-5 relative (GEMM relative to `|alpha| |A| |B| + |beta| |C|`,
//! the scale its rounding error grows with, since single elements can cancel to near zero);
//! the operations whose CUDA kernels follow the
//! CPU loop operation by operation (aggregation, gather/scatter, dropout masks, element-wise
//! ops, Adam, column sums) must agree bit for bit.
//!
//! Needs a GPU: each test skips (with a message) when no CUDA driver library is present or no
//! device can be opened. Set `GRANDIS_REQUIRE_GPU=1` to turn those skips into failures on a
//! machine that is supposed to have a GPU. Run with
//! `cargo test -p grandis-engine --features cuda --test cuda_parity -- --nocapture`.
#![cfg(feature = "cuda")]

mod common;

use common::{cpu, random_graph, rnd};
use grandis_engine::cuda::{driver_library_present, CudaBackend};
use grandis_engine::norm::{full_block, global_scales, sub_block, Aggregation};
use grandis_engine::{dropout_keep, dropout_threshold, AdamStep, Backend, DropoutKey, Kernels};
use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;

const TOL: f32 = 1e-5;

/// Elements smaller than this are held to `TOL * FLOOR` absolute error: their rounding error
/// comes from the larger terms that cancelled in them.
const FLOOR: f32 = 0.1;

fn gpu() -> Option<CudaBackend> {
    grandis_engine::cuda::device_for_tests()
}

fn down(g: &CudaBackend, buf: &<CudaBackend as Kernels>::Buf) -> Vec<f32> {
    let mut out = vec![0.0; g.len(buf)];
    g.download(buf, 0, &mut out).unwrap();
    out
}

/// Element-wise `|a - b| <= TOL * max(|a|, |b|, FLOOR)`; prints how many are bit-identical
/// and the worst error relative to that scale.
fn assert_close(name: &str, want: &[f32], got: &[f32]) {
    let scale: Vec<f32> = want
        .iter()
        .zip(got)
        .map(|(a, b)| a.abs().max(b.abs()))
        .collect();
    assert_close_to(name, want, got, &scale);
}

/// Element-wise `|a - b| <= TOL * max(scale, FLOOR)`.
fn assert_close_to(name: &str, want: &[f32], got: &[f32], scale: &[f32]) {
    assert_eq!(want.len(), got.len(), "{name}: lengths differ");
    let (mut exact, mut worst) = (0, 0.0f32);
    for (i, ((&a, &b), &s)) in want.iter().zip(got).zip(scale).enumerate() {
        if a.to_bits() == b.to_bits() {
            exact += 1;
            continue;
        }
        let err = (a - b).abs() / s.max(FLOOR);
        assert!(
            err <= TOL,
            "{name}: element {i}: cpu {a}, cuda {b} ({err:.2e} of scale {s})"
        );
        worst = worst.max(err);
    }
    eprintln!(
        "{name}: {exact}/{} bit-identical, worst error {worst:.1e} relative",
        want.len()
    );
}

fn assert_bits(name: &str, want: &[f32], got: &[f32]) {
    assert_eq!(want.len(), got.len(), "{name}: lengths differ");
    for (i, (&a, &b)) in want.iter().zip(got).enumerate() {
        assert!(
            a.to_bits() == b.to_bits(),
            "{name}: element {i}: cpu {a}, cuda {b} (expected identical bits)"
        );
    }
}

#[test]
fn constructing_the_backend_never_panics() {
    // Runs everywhere: without a driver this must be the clean error, not a panic.
    match CudaBackend::new(0) {
        Ok(b) => eprintln!("opened {} ({})", b.name(), b.device_name()),
        Err(e) => {
            let msg = e.to_string();
            if !driver_library_present() {
                assert!(
                    msg.contains("CUDA driver library not found") && msg.contains("cuda:0"),
                    "unexpected error without a driver: {msg}"
                );
            }
            eprintln!("CudaBackend::new(0): {msg}");
        }
    }
    // An ordinal no machine has is an error either way.
    assert!(CudaBackend::new(1 << 20).is_err());
}

#[test]
fn buffers_round_trip() {
    let Some(g) = gpu() else { return };
    let host = rnd(1000, 1);
    let mut buf = g.upload(&host).unwrap();
    assert_eq!(g.len(&buf), 1000);
    assert_bits("upload/download", &host, &down(&g, &buf));
    // An owned upload copies to the device and hands the host buffer back for reuse, from
    // plain and from page-locked memory alike.
    let (owned, back) = g
        .upload_host(grandis_engine::HostBuffer::from_vec(host.clone()))
        .unwrap();
    assert_bits("owned upload", &host, &down(&g, &owned));
    assert_eq!(back.as_slice(), &host[..]);
    let pinned_alloc = grandis_engine::cuda::PinnedAllocator::new(0).unwrap();
    let mut pinned = grandis_engine::HostAllocator::alloc(&pinned_alloc, 2000).unwrap();
    assert!(pinned.is_pinned() && pinned.capacity() >= 2000);
    pinned.set_len(1000).unwrap();
    pinned.as_mut_slice().copy_from_slice(&host);
    assert!(
        pinned.set_len(4000).is_err(),
        "page-locked memory never grows"
    );
    let (from_pinned, back) = g.upload_host(pinned).unwrap();
    assert_bits(
        "upload from page-locked memory",
        &host,
        &down(&g, &from_pinned),
    );
    assert!(back.is_pinned());
    g.upload_into(&mut buf, 990, &[7.0; 10]).unwrap();
    let mut tail = [0.0f32; 12];
    g.download(&buf, 988, &mut tail).unwrap();
    assert_eq!(&tail[..2], &host[988..990]);
    assert_eq!(&tail[2..], &[7.0; 10]);
    assert!(g.upload_into(&mut buf, 995, &[1.0; 10]).is_err());
    assert!(g.download(&buf, 995, &mut [0.0; 10]).is_err());

    let z = g.alloc(37).unwrap();
    assert_eq!(down(&g, &z), vec![0.0; 37]);
    let empty = g.alloc(0).unwrap();
    assert_eq!(g.len(&empty), 0);
    let empty_up = g.upload(&[]).unwrap();
    assert_eq!(g.len(&empty_up), 0);

    let mut f = g.alloc(100).unwrap();
    g.fill(&mut f, 60, 2.5).unwrap();
    let v = down(&g, &f);
    assert!(v[..60].iter().all(|&x| x == 2.5) && v[60..].iter().all(|&x| x == 0.0));
    let mut c = g.alloc(1000).unwrap();
    g.copy(&buf, &mut c, 500).unwrap();
    let v = down(&g, &c);
    assert_bits("copy", &host[..500], &v[..500]);
    assert!(v[500..].iter().all(|&x| x == 0.0));
    assert!(g.copy(&buf, &mut f, 500).is_err());

    let idx = g.upload_index(&[3, 1, 4, 1, 5]).unwrap();
    assert_eq!(g.index_len(&idx), 5);
    g.synchronize().unwrap();
}

#[test]
fn gemm_matches_cpu_for_all_transposes() {
    let Some(g) = gpu() else { return };
    let c = cpu();
    for (m, n, k) in [(7, 5, 9), (64, 33, 128), (1, 1, 1), (300, 16, 40)] {
        for ta in [false, true] {
            for tb in [false, true] {
                for beta in [0.0f32, 0.5] {
                    let a = rnd(m * k, 1);
                    let b = rnd(k * n, 2);
                    let mut c0 = rnd(m * n, 3);
                    if beta == 0.0 {
                        c0[0] = f32::NAN; // beta = 0 must ignore old contents
                    }
                    let mut want = c0.clone();
                    c.gemm(ta, tb, m, n, k, 1.5, &a, &b, beta, &mut want)
                        .unwrap();
                    let (ga, gb) = (g.upload(&a).unwrap(), g.upload(&b).unwrap());
                    let mut gc = g.upload(&c0).unwrap();
                    g.gemm(ta, tb, m, n, k, 1.5, &ga, &gb, beta, &mut gc)
                        .unwrap();
                    // The scale of each element's rounding error: the same product on
                    // absolute values.
                    let abs = |v: &[f32]| v.iter().map(|x| x.abs()).collect::<Vec<_>>();
                    let mut scale = abs(&c0);
                    c.gemm(ta, tb, m, n, k, 1.5, &abs(&a), &abs(&b), beta, &mut scale)
                        .unwrap();
                    assert_close_to(
                        &format!("gemm {m}x{n}x{k} ta={ta} tb={tb} beta={beta}"),
                        &want,
                        &down(&g, &gc),
                        &scale,
                    );
                }
            }
        }
    }
    // k = 0: C = beta * C.
    let (ga, gb) = (g.upload(&[]).unwrap(), g.upload(&[]).unwrap());
    let mut gc = g.upload(&[1.0, f32::NAN, 3.0, 4.0]).unwrap();
    g.gemm(false, false, 2, 2, 0, 1.0, &ga, &gb, 0.0, &mut gc)
        .unwrap();
    assert_eq!(down(&g, &gc), vec![0.0; 4]);
    let mut gc = g.upload(&[1.0, 2.0, 3.0, 4.0]).unwrap();
    g.gemm(false, false, 2, 2, 0, 1.0, &ga, &gb, 0.5, &mut gc)
        .unwrap();
    assert_eq!(down(&g, &gc), vec![0.5, 1.0, 1.5, 2.0]);
    // Short buffers are shape errors.
    let small = g.upload(&[1.0; 3]).unwrap();
    let mut out = g.alloc(4).unwrap();
    assert!(g
        .gemm(false, false, 2, 2, 2, 1.0, &small, &small, 0.0, &mut out)
        .is_err());
}

#[test]
fn bias_and_column_sums_match_cpu() {
    let Some(g) = gpu() else { return };
    let c = cpu();
    // 9000 rows spans three reduction chunks of 4096 rows.
    for (rows, cols) in [(5, 3), (9000, 7), (0, 4)] {
        let x = rnd(rows * cols, 4);
        let bias = rnd(cols, 5);
        let mut want = x.clone();
        c.add_bias(&mut want, &bias, rows, cols).unwrap();
        let mut gx = g.upload(&x).unwrap();
        g.add_bias(&mut gx, &g.upload(&bias).unwrap(), rows, cols)
            .unwrap();
        assert_bits("add_bias", &want, &down(&g, &gx));
        // The fused bias and ReLU: the CPU's two passes, bit for bit.
        let mut relu = vec![0.0; rows * cols];
        c.relu(&want, &mut relu, rows * cols).unwrap();
        let mut gout = g.alloc(rows * cols).unwrap();
        g.bias_relu(
            &g.upload(&x).unwrap(),
            &g.upload(&bias).unwrap(),
            &mut gout,
            rows,
            cols,
        )
        .unwrap();
        assert_bits("bias_relu", &relu, &down(&g, &gout));
        for beta in [0.0f32, 1.0, 0.25] {
            let init = rnd(cols, 6);
            let mut want = init.clone();
            c.col_sum(&x, rows, cols, beta, &mut want).unwrap();
            let mut gout = g.upload(&init).unwrap();
            g.col_sum(&g.upload(&x).unwrap(), rows, cols, beta, &mut gout)
                .unwrap();
            assert_bits(
                &format!("col_sum {rows}x{cols} beta={beta}"),
                &want,
                &down(&g, &gout),
            );
        }
    }
}

#[test]
fn gather_and_scatter_match_cpu() {
    let Some(g) = gpu() else { return };
    let c = cpu();
    let cols = 5;
    let src = rnd(20 * cols, 7);
    let ids: Vec<u32> = vec![3, 19, 0, 3, 7, 7, 7, 12];
    let mut want = vec![0.0; ids.len() * cols];
    c.gather_rows(&src, cols, &ids, &mut want).unwrap();
    let gids = g.upload_index(&ids).unwrap();
    let mut gout = g.alloc(ids.len() * cols).unwrap();
    g.gather_rows(&g.upload(&src).unwrap(), cols, &gids, &mut gout)
        .unwrap();
    assert_bits("gather_rows", &want, &down(&g, &gout));

    // Repeated ids add up in index order.
    let contrib = rnd(ids.len() * cols, 8);
    let base = rnd(20 * cols, 9);
    let mut want = base.clone();
    c.scatter_add_rows(&contrib, cols, &ids, &mut want).unwrap();
    let mut gbase = g.upload(&base).unwrap();
    let gcontrib = g.upload(&contrib).unwrap();
    g.scatter_add_rows(&gcontrib, cols, &gids, &mut gbase)
        .unwrap();
    assert_bits("scatter_add_rows", &want, &down(&g, &gbase));
    // The cached grouping is reused on a second call.
    c.scatter_add_rows(&contrib, cols, &ids, &mut want).unwrap();
    g.scatter_add_rows(&gcontrib, cols, &gids, &mut gbase)
        .unwrap();
    assert_bits("scatter_add_rows (again)", &want, &down(&g, &gbase));

    let bad = g.upload_index(&[20]).unwrap();
    assert!(g
        .gather_rows(&g.upload(&src).unwrap(), cols, &bad, &mut gout)
        .is_err());
    assert!(g
        .scatter_add_rows(&gcontrib, cols, &bad, &mut gbase)
        .is_err());
}

#[test]
fn aggregation_forward_and_backward_match_cpu_bit_for_bit() {
    let Some(g) = gpu() else { return };
    let c = cpu();
    let graph = random_graph(200, 1500, 10);
    for agg in [Aggregation::Mean, Aggregation::Sum, Aggregation::Gcn] {
        for d in [1, 4, 5, 32, 100, 130, 256] {
            // The full graph, and a block with halo rows (every third vertex owned).
            let full = full_block(graph.view(), agg);
            let (_, _, part) = common::every_third_block(&graph, agg);
            for (label, blk) in [("full", &full), ("block", &part)] {
                let name = format!("{agg:?} {label} d={d}");
                let cg = c.upload_graph(blk).unwrap();
                // Blocks go up both ways: checked and transposed on the host ahead
                // (`PreparedGraph`, as step producers do) and directly.
                let gg = if label == "block" {
                    let prepared = grandis_engine::PreparedGraph::new(blk.clone()).unwrap();
                    g.upload_prepared(&prepared).unwrap()
                } else {
                    g.upload_graph(blk).unwrap()
                };
                assert_eq!(c.graph_dims(&cg), g.graph_dims(&gg));
                let x = rnd(blk.n_src * d, 11);
                let mut want = vec![0.0; blk.n_dst * d];
                c.aggregate(&cg, &x, d, &mut want).unwrap();
                let mut gout = g.upload(&vec![f32::NAN; blk.n_dst * d]).unwrap();
                g.aggregate(&gg, &g.upload(&x).unwrap(), d, &mut gout)
                    .unwrap();
                assert_bits(&format!("aggregate {name}"), &want, &down(&g, &gout));

                let go = rnd(blk.n_dst * d, 12);
                let mut want = vec![0.0; blk.n_src * d];
                c.aggregate_backward(&cg, &go, d, &mut want).unwrap();
                let mut gx = g.upload(&vec![f32::NAN; blk.n_src * d]).unwrap();
                g.aggregate_backward(&gg, &g.upload(&go).unwrap(), d, &mut gx)
                    .unwrap();
                assert_bits(&format!("aggregate_backward {name}"), &want, &down(&g, &gx));
            }
        }
    }
    // Invalid blocks are rejected before anything is uploaded.
    let mut bad = full_block(graph.view(), Aggregation::Mean);
    bad.indices[0] = 10_000;
    assert!(g.upload_graph(&bad).is_err());
}

#[test]
fn elementwise_ops_match_cpu_bit_for_bit() {
    let Some(g) = gpu() else { return };
    let c = cpu();
    let n = 70_001;
    let x = rnd(n, 13);
    let y0 = rnd(n, 14);

    let mut want = vec![0.0; n];
    c.relu(&x, &mut want, n).unwrap();
    let gx = g.upload(&x).unwrap();
    let mut gy = g.alloc(n).unwrap();
    g.relu(&gx, &mut gy, n).unwrap();
    assert_bits("relu", &want, &down(&g, &gy));

    let mut want = y0.clone();
    c.relu_backward(&x, &mut want, n).unwrap();
    let mut gg = g.upload(&y0).unwrap();
    g.relu_backward(&gx, &mut gg, n).unwrap();
    assert_bits("relu_backward", &want, &down(&g, &gg));

    let mut want = y0.clone();
    c.axpy(0.37, &x, &mut want, n - 1).unwrap();
    let mut gg = g.upload(&y0).unwrap();
    g.axpy(0.37, &gx, &mut gg, n - 1).unwrap();
    assert_bits("axpy", &want, &down(&g, &gg));

    let mut want = y0.clone();
    c.scale(&mut want, -1.7, n).unwrap();
    let mut gg = g.upload(&y0).unwrap();
    g.scale(&mut gg, -1.7, n).unwrap();
    assert_bits("scale", &want, &down(&g, &gg));
}

#[test]
fn dropout_masks_are_the_cpu_formula() {
    let Some(g) = gpu() else { return };
    let c = cpu();
    let (rows, cols) = (300, 67);
    // Global ids far apart, including the top of the u32 range (the hash takes gid << 32).
    let ids: Vec<u32> = (0..rows as u32)
        .map(|i| if i % 2 == 0 { i * 7919 } else { u32::MAX - i })
        .collect();
    let gids = g.upload_index(&ids).unwrap();
    let key = DropoutKey {
        seed: 0xdead_beef_1234,
        epoch: 17,
        layer: 3,
    };
    for p in [0.0f32, 0.1, 0.5, 0.9] {
        // Ones in, so a kept element is exactly 1 / (1 - p) and a dropped one 0.
        let ones = vec![1.0f32; rows * cols];
        let mut out = g.alloc(rows * cols).unwrap();
        g.dropout(
            &g.upload(&ones).unwrap(),
            &mut out,
            rows,
            cols,
            &gids,
            p,
            key,
        )
        .unwrap();
        let got = down(&g, &out);
        let thr = dropout_threshold(p);
        let mut kept = 0usize;
        for r in 0..rows {
            for col in 0..cols {
                let want = p == 0.0 || dropout_keep(key.stream(), thr, ids[r], col as u32);
                let v = got[r * cols + col];
                assert_eq!(v != 0.0, want, "p={p} row {r} (gid {}) col {col}", ids[r]);
                kept += want as usize;
            }
        }
        eprintln!("dropout p={p}: kept {kept}/{}", rows * cols);

        let x = rnd(rows * cols, 15);
        let mut want = vec![0.0; rows * cols];
        c.dropout(&x, &mut want, rows, cols, &ids, p, key).unwrap();
        let mut gout = g.alloc(rows * cols).unwrap();
        g.dropout(&g.upload(&x).unwrap(), &mut gout, rows, cols, &gids, p, key)
            .unwrap();
        assert_bits(&format!("dropout p={p}"), &want, &down(&g, &gout));

        let mut want = x.clone();
        c.dropout_backward(&mut want, rows, cols, &ids, p, key)
            .unwrap();
        let mut gg = g.upload(&x).unwrap();
        g.dropout_backward(&mut gg, rows, cols, &gids, p, key)
            .unwrap();
        assert_bits(&format!("dropout_backward p={p}"), &want, &down(&g, &gg));
    }
    let mut out = g.alloc(rows * cols).unwrap();
    let x = g.upload(&vec![1.0; rows * cols]).unwrap();
    assert!(g
        .dropout(&x, &mut out, rows, cols, &gids, 1.0, key)
        .is_err());
}

#[test]
fn layer_norm_matches_cpu() {
    let Some(g) = gpu() else { return };
    let c = cpu();
    for (rows, cols) in [(3, 1), (50, 16), (5000, 100)] {
        let x: Vec<f32> = rnd(rows * cols, 16).iter().map(|v| v * 3.0 + 0.5).collect();
        let gamma = rnd(cols, 17);
        let beta = rnd(cols, 18);
        let mut out = vec![0.0; rows * cols];
        let (mut mean, mut rstd) = (vec![0.0; rows], vec![0.0; rows]);
        c.layer_norm(
            &x, &gamma, &beta, rows, cols, 1e-5, &mut out, &mut mean, &mut rstd,
        )
        .unwrap();
        let (gx, ggamma, gbeta) = (
            g.upload(&x).unwrap(),
            g.upload(&gamma).unwrap(),
            g.upload(&beta).unwrap(),
        );
        let mut gout = g.alloc(rows * cols).unwrap();
        let (mut gmean, mut grstd) = (g.alloc(rows).unwrap(), g.alloc(rows).unwrap());
        g.layer_norm(
            &gx, &ggamma, &gbeta, rows, cols, 1e-5, &mut gout, &mut gmean, &mut grstd,
        )
        .unwrap();
        let name = format!("{rows}x{cols}");
        assert_close(&format!("layer_norm out {name}"), &out, &down(&g, &gout));
        assert_close(&format!("layer_norm mean {name}"), &mean, &down(&g, &gmean));
        assert_close(&format!("layer_norm rstd {name}"), &rstd, &down(&g, &grstd));

        // Backward from the CPU's saved statistics on both sides, so only the backward
        // kernels are compared.
        let gy = rnd(rows * cols, 19);
        let gg0 = rnd(cols, 20);
        let gb0 = rnd(cols, 21);
        let mut dx = vec![0.0; rows * cols];
        let (mut dg, mut db) = (gg0.clone(), gb0.clone());
        c.layer_norm_backward(
            &gy, &x, &gamma, &mean, &rstd, rows, cols, &mut dx, &mut dg, &mut db,
        )
        .unwrap();
        let mut gdx = g.alloc(rows * cols).unwrap();
        let (mut gdg, mut gdb) = (g.upload(&gg0).unwrap(), g.upload(&gb0).unwrap());
        g.layer_norm_backward(
            &g.upload(&gy).unwrap(),
            &gx,
            &ggamma,
            &g.upload(&mean).unwrap(),
            &g.upload(&rstd).unwrap(),
            rows,
            cols,
            &mut gdx,
            &mut gdg,
            &mut gdb,
        )
        .unwrap();
        assert_close(&format!("layer_norm grad_x {name}"), &dx, &down(&g, &gdx));
        // Parameter gradients use the CPU's chunked f64 order exactly.
        assert_bits(
            &format!("layer_norm grad_gamma {name}"),
            &dg,
            &down(&g, &gdg),
        );
        assert_bits(
            &format!("layer_norm grad_beta {name}"),
            &db,
            &down(&g, &gdb),
        );
    }
}

#[test]
fn cross_entropy_matches_cpu() {
    let Some(g) = gpu() else { return };
    let c = cpu();
    for (n, classes) in [(10, 3), (500, 47), (64, 100)] {
        let logits: Vec<f32> = rnd(n * classes, 22).iter().map(|v| v * 4.0).collect();
        let rows: Vec<u32> = (0..n as u32).filter(|r| r % 3 != 2).collect();
        let mut r = ChaCha8Rng::seed_from_u64(23);
        let labels: Vec<u32> = rows
            .iter()
            .map(|_| r.gen_range(0..classes as u32))
            .collect();
        let norm = 1234.0;
        let mut want = vec![0.0; n * classes];
        let loss = c
            .cross_entropy(&logits, n, classes, &rows, &labels, norm, &mut want)
            .unwrap();
        let (grows, glabels) = (
            g.upload_index(&rows).unwrap(),
            g.upload_index(&labels).unwrap(),
        );
        let mut ggrad = g.upload(&vec![f32::NAN; n * classes]).unwrap();
        let gloss = g
            .cross_entropy(
                &g.upload(&logits).unwrap(),
                n,
                classes,
                &grows,
                &glabels,
                norm,
                &mut ggrad,
            )
            .unwrap();
        assert!(
            (loss - gloss).abs() <= 1e-9 * loss.abs().max(1.0),
            "loss {n}x{classes}: cpu {loss}, cuda {gloss}"
        );
        assert_close(
            &format!("cross_entropy grad {n}x{classes}"),
            &want,
            &down(&g, &ggrad),
        );
    }
    let gl = g.upload(&[0.0; 6]).unwrap();
    let mut gr = g.alloc(6).unwrap();
    let rows = g.upload_index(&[0, 1]).unwrap();
    let bad_label = g.upload_index(&[0, 3]).unwrap();
    assert!(g
        .cross_entropy(&gl, 2, 3, &rows, &bad_label, 1.0, &mut gr)
        .is_err());
    let bad_row = g.upload_index(&[2]).unwrap();
    let one = g.upload_index(&[0]).unwrap();
    assert!(g
        .cross_entropy(&gl, 2, 3, &bad_row, &one, 1.0, &mut gr)
        .is_err());
    assert!(g
        .cross_entropy(&gl, 2, 3, &one, &one, 0.0, &mut gr)
        .is_err());
}

#[test]
fn sum_squares_and_adam_match_cpu() {
    let Some(g) = gpu() else { return };
    let c = cpu();
    for n in [0usize, 1, 1000, 100_000] {
        let x = rnd(n, 24);
        let want = c.sum_squares(&x, n).unwrap();
        let got = g.sum_squares(&g.upload(&x).unwrap(), n).unwrap();
        assert!(
            (want - got).abs() <= 1e-12 * want.max(1.0),
            "sum_squares n={n}: cpu {want}, cuda {got}"
        );
    }
    let n = 10_007;
    for decoupled in [false, true] {
        let mut w = rnd(n, 25);
        let (mut m, mut v) = (vec![0.0; n], vec![0.0; n]);
        let mut gw = g.upload(&w).unwrap();
        let (mut gm, mut gv) = (g.alloc(n).unwrap(), g.alloc(n).unwrap());
        for step in 1..=5u64 {
            let grad = rnd(n, 100 + step);
            let s = AdamStep {
                weight_decay: 0.05,
                decoupled,
                grad_scale: 0.7,
                ..AdamStep::new(0.01, step)
            };
            c.adam_step(&mut w, &grad, &mut m, &mut v, n, &s).unwrap();
            g.adam_step(&mut gw, &g.upload(&grad).unwrap(), &mut gm, &mut gv, n, &s)
                .unwrap();
        }
        let name = if decoupled { "adamw" } else { "adam" };
        assert_bits(&format!("{name} param"), &w, &down(&g, &gw));
        assert_bits(&format!("{name} m"), &m, &down(&g, &gm));
        assert_bits(&format!("{name} v"), &v, &down(&g, &gv));
    }
    let s = AdamStep::new(0.01, 0);
    let mut a = g.alloc(4).unwrap();
    let (mut b, mut d) = (g.alloc(4).unwrap(), g.alloc(4).unwrap());
    let grad = g.alloc(4).unwrap();
    assert!(g.adam_step(&mut a, &grad, &mut b, &mut d, 4, &s).is_err());
}

#[test]
fn attention_matches_cpu() {
    let Some(g) = gpu() else { return };
    let c = cpu();
    let graph = random_graph(400, 4000, 31);
    let dst: Vec<u32> = (0..400).filter(|v| v % 3 == 0).collect();
    let mut src = dst.clone();
    let mut seen: std::collections::HashSet<u32> = dst.iter().copied().collect();
    for &v in &dst {
        for &u in graph.view().neighbors(v) {
            if seen.insert(u) {
                src.push(u);
            }
        }
    }
    let scales = global_scales(graph.view(), Aggregation::Mean);
    let blk = sub_block(graph.view(), &scales, &dst, &src).unwrap();
    let (cg, gg) = (c.upload_graph(&blk).unwrap(), g.upload_graph(&blk).unwrap());
    let gids = g.upload_index(&src).unwrap();
    let (n_dst, n_src) = (blk.n_dst, blk.n_src);
    for (heads, f, concat, p) in [(8usize, 8usize, true, Some(0.6f32)), (1, 7, false, None)] {
        let name = format!("attention heads {heads} concat {concat} p {p:?}");
        let key = DropoutKey {
            seed: 1,
            epoch: 4,
            layer: 2,
        };
        let (ca, ga) = (
            attention(heads, f, concat, p, key, &src),
            attention(heads, f, concat, p, key, &gids),
        );
        let (cols, oc, two_h) = (heads * f, ca.out_cols(), 2 * heads);
        let (x, sc, go) = (
            rnd(n_src * cols, 32),
            rnd(n_src * two_h, 33),
            rnd(n_dst * oc, 34),
        );
        let (mut out, mut lse) = (vec![0.0; n_dst * oc], vec![0.0; n_dst * heads]);
        c.attention_aggregate(&cg, &x, &sc, &ca, &mut out, &mut lse)
            .unwrap();
        let (gx_, gsc, ggo) = (
            g.upload(&x).unwrap(),
            g.upload(&sc).unwrap(),
            g.upload(&go).unwrap(),
        );
        let (mut gout, mut glse) = (
            g.alloc(n_dst * oc).unwrap(),
            g.alloc(n_dst * heads).unwrap(),
        );
        g.attention_aggregate(&gg, &gx_, &gsc, &ga, &mut gout, &mut glse)
            .unwrap();
        assert_close(&format!("{name} out"), &out, &down(&g, &gout));
        assert_close(&format!("{name} lse"), &lse, &down(&g, &glse));
        let mut want = (
            vec![0.0; n_src * cols],
            vec![0.0; n_src * two_h],
            vec![0.0; n_dst * heads],
        );
        c.attention_aggregate_backward(
            &cg,
            &x,
            &sc,
            &lse,
            &ca,
            &go,
            &mut want.0,
            &mut want.1,
            &mut want.2,
        )
        .unwrap();
        let mut got = (
            g.alloc(n_src * cols).unwrap(),
            g.alloc(n_src * two_h).unwrap(),
            g.alloc(n_dst * heads).unwrap(),
        );
        g.attention_aggregate_backward(
            &gg, &gx_, &gsc, &glse, &ga, &ggo, &mut got.0, &mut got.1, &mut got.2,
        )
        .unwrap();
        assert_close(&format!("{name} grad_x"), &want.0, &down(&g, &got.0));
        assert_close(&format!("{name} grad_scores"), &want.1, &down(&g, &got.1));
    }
}

fn attention<I>(
    heads: usize,
    head_dim: usize,
    concat: bool,
    p: Option<f32>,
    key: DropoutKey,
    global_ids: &I,
) -> grandis_engine::Attention<'_, I> {
    grandis_engine::Attention {
        heads,
        head_dim,
        concat,
        negative_slope: 0.2,
        self_loops: true,
        dropout: p.map(|p| grandis_engine::AttentionDropout { global_ids, p, key }),
    }
}
