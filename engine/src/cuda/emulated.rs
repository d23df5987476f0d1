//! Runs the CUDA kernel source ([`super::kernels::SOURCE`]) on the host, so the kernels are
//! exercised on machines without a GPU: the source is compiled as C++ with `g++` against a
//! small emulation of the CUDA built-ins (`emu_prelude.h`: one `std::thread` per CUDA
//! thread, barriers for warp shuffles and `__syncthreads`), with the launch shapes of the
//! real backend (`elem_cfg`, `csr_cfg`, ...), and the results are compared with
//! [`CpuBackend`]. The bit-for-bit claims of the kernels module are asserted here; the
//! cuBLAS argument mapping of `gemm` is checked against a column-major reference product.
//!
//! Skips (with a message) when no C++20 compiler is available, unless `GRANDIS_REQUIRE_CXX=1`
//! (set by `.ci/run`) makes that a failure. It cannot catch what only a
//! device shows (NVRTC dialect, PTX loading, launch limits, real concurrency): those are the
//! parity tests of `tests/cuda_parity.rs`, which need a GPU.

use super::kernels;
use super::*;
use crate::args::{dropout_threshold, AdamStep, AttentionDropout, DropoutKey};
use crate::backend::Backend;
use crate::block::{BlockGraph, ScaledCsr};
use crate::cpu::CpuBackend;
use crate::norm::{full_block, global_scales, sub_block, Aggregation};
use cudarc::driver::LaunchConfig;
use grandis_store::EdgeOptions;
use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;
use std::ffi::{c_char, c_int, c_void, CString};
use std::path::{Path, PathBuf};
use std::process::Command;

extern "C" {
    fn dlopen(filename: *const c_char, flag: c_int) -> *mut c_void;
    fn dlsym(handle: *mut c_void, symbol: *const c_char) -> *mut c_void;
}
const RTLD_NOW: c_int = 2;

/// C++ wrappers `run_<kernel>(grid_x, grid_y, block_x, block_y, <kernel params>)`, generated
/// from the kernel signatures in the source.
fn wrappers() -> String {
    let mut out = String::from("#include \"emu_prelude.h\"\n#include \"kernels.cu\"\n");
    let marker = "extern \"C\" __global__ void ";
    let src = kernels::SOURCE;
    let mut rest = src;
    while let Some(pos) = rest.find(marker) {
        let after = &rest[pos + marker.len()..];
        let open = after.find('(').unwrap();
        let close = after.find(')').unwrap();
        let name = after[..open].trim();
        let params: Vec<String> = after[open + 1..close]
            .split(',')
            .map(|p| p.split_whitespace().collect::<Vec<_>>().join(" "))
            .collect();
        let args: Vec<&str> = params
            .iter()
            .map(|p| p.rsplit(' ').next().unwrap().trim_start_matches('*'))
            .collect();
        out.push_str(&format!(
            "extern \"C\" void run_{name}(unsigned grid_x, unsigned grid_y, unsigned blk_x, \
             unsigned blk_y, {}) {{ emu_launch(dim3{{grid_x, grid_y, 1}}, \
             dim3{{blk_x, blk_y, 1}}, [=] {{ {name}({}); }}); }}\n",
            params.join(", "),
            args.join(", ")
        ));
        rest = &after[close..];
    }
    out
}

struct Emu {
    handle: *mut c_void,
    dir: PathBuf,
}

impl Drop for Emu {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

fn gxx(dir: &Path, args: &[&str]) -> std::io::Result<std::process::Output> {
    Command::new("g++").current_dir(dir).args(args).output()
}

impl Emu {
    /// Compiles the kernels into a shared library and loads it; `None` when this machine has
    /// no C++20 compiler (the only reason to skip).
    fn build() -> Option<Emu> {
        let dir = std::env::temp_dir().join(format!("grandis-cuda-emu-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let mut emu = Emu {
            handle: std::ptr::null_mut(),
            dir,
        };
        std::fs::write(
            emu.dir.join("probe.cpp"),
            "#include <barrier>\nint main() { std::barrier<> b(1); b.arrive_and_wait(); }\n",
        )
        .unwrap();
        match gxx(
            &emu.dir,
            &["-std=c++20", "probe.cpp", "-o", "probe", "-lpthread"],
        ) {
            Ok(o) if o.status.success() => {}
            _ => {
                // CI sets this: there the emulator must run, a missing compiler is a failure.
                assert!(
                    std::env::var("GRANDIS_REQUIRE_CXX").as_deref() != Ok("1"),
                    "GRANDIS_REQUIRE_CXX=1 but there is no g++ with C++20 <barrier> to \
                     emulate the CUDA kernels (apt-get install g++)"
                );
                eprintln!("skipping: no g++ with C++20 <barrier> to emulate the CUDA kernels");
                return None;
            }
        }
        std::fs::write(emu.dir.join("emu_prelude.h"), include_str!("emu_prelude.h")).unwrap();
        std::fs::write(emu.dir.join("kernels.cu"), kernels::SOURCE).unwrap();
        std::fs::write(emu.dir.join("wrappers.cpp"), wrappers()).unwrap();
        // -ffp-contract=off: like --fmad=false in NVRTC, no fused multiply-add.
        let out = gxx(
            &emu.dir,
            &[
                "-std=c++20",
                "-O1",
                "-ffp-contract=off",
                "-fPIC",
                "-shared",
                "wrappers.cpp",
                "-o",
                "libemu.so",
                "-lpthread",
            ],
        )
        .unwrap();
        assert!(
            out.status.success(),
            "the kernel source does not compile as C++:\n{}",
            String::from_utf8_lossy(&out.stderr)
        );
        let path = CString::new(emu.dir.join("libemu.so").to_str().unwrap()).unwrap();
        // SAFETY: loads the library just built; its initialisers only set up statics.
        emu.handle = unsafe { dlopen(path.as_ptr(), RTLD_NOW) };
        assert!(
            !emu.handle.is_null(),
            "dlopen of the emulated kernels failed"
        );
        Some(emu)
    }

    /// The wrapper of `kernel`, as a function pointer of type `F`.
    fn sym<F: Copy>(&self, kernel: &str) -> F {
        let name = CString::new(format!("run_{kernel}")).unwrap();
        // SAFETY: dlsym on a live handle.
        let p = unsafe { dlsym(self.handle, name.as_ptr()) };
        assert!(!p.is_null(), "no wrapper for kernel {kernel}");
        assert_eq!(std::mem::size_of::<F>(), std::mem::size_of::<*mut c_void>());
        // SAFETY: F is the extern "C" fn type of the wrapper (the call sites spell out the
        // kernel's parameter types).
        unsafe { std::mem::transmute_copy::<*mut c_void, F>(&p) }
    }
}

/// `launch!(emu, "kernel", cfg, (param types...), args...)`: runs the emulated kernel with
/// the grid and block of a real [`LaunchConfig`].
macro_rules! launch {
    ($emu:expr, $name:expr, $cfg:expr, ($($t:ty),*), $($arg:expr),* $(,)?) => {{
        let cfg: LaunchConfig = $cfg;
        assert_eq!((cfg.grid_dim.2, cfg.block_dim.2), (1, 1));
        let f: unsafe extern "C" fn(u32, u32, u32, u32, $($t),*) = $emu.sym($name);
        // SAFETY: the arguments are host buffers of the sizes the kernel indexes.
        unsafe { f(cfg.grid_dim.0, cfg.grid_dim.1, cfg.block_dim.0, cfg.block_dim.1, $($arg),*) }
    }};
}

fn rnd(n: usize, seed: u64) -> Vec<f32> {
    let mut r = ChaCha8Rng::seed_from_u64(seed);
    (0..n).map(|_| r.gen_range(-1.0f32..1.0)).collect()
}

fn bits(name: &str, want: &[f32], got: &[f32]) {
    assert_eq!(want.len(), got.len(), "{name}: lengths");
    for (i, (a, b)) in want.iter().zip(got).enumerate() {
        assert!(
            a.to_bits() == b.to_bits(),
            "{name}: element {i}: cpu {a}, emulated kernel {b}"
        );
    }
}

fn close(name: &str, want: &[f32], got: &[f32]) {
    assert_eq!(want.len(), got.len(), "{name}: lengths");
    for (i, (&a, &b)) in want.iter().zip(got).enumerate() {
        let tol = 1e-4 * a.abs().max(b.abs()) + 1e-6;
        assert!(
            a.to_bits() == b.to_bits() || (a - b).abs() <= tol,
            "{name}: element {i}: cpu {a}, emulated kernel {b}"
        );
    }
}

/// cuBLAS `sgemm` semantics (column-major), as a reference for the argument mapping.
#[allow(clippy::too_many_arguments)]
fn colmajor_sgemm(
    ta: bool,
    tb: bool,
    m: usize,
    n: usize,
    k: usize,
    alpha: f32,
    a: &[f32],
    lda: usize,
    b: &[f32],
    ldb: usize,
    beta: f32,
    c: &mut [f32],
    ldc: usize,
) {
    for j in 0..n {
        for i in 0..m {
            let mut s = 0.0f64;
            for p in 0..k {
                let av = if ta { a[p + i * lda] } else { a[i + p * lda] };
                let bv = if tb { b[j + p * ldb] } else { b[p + j * ldb] };
                s += av as f64 * bv as f64;
            }
            let cv = &mut c[i + j * ldc];
            *cv = alpha * s as f32 + beta * *cv;
        }
    }
}

fn run_csr(emu: &Emu, g: &ScaledCsr, x: &[f32], d: usize, out: &mut [f32]) {
    let n_rows = g.offsets.len() - 1;
    if n_rows == 0 || d == 0 {
        return;
    }
    let src = g.src.as_ref().unwrap_or(&g.dst);
    let slf = g.self_.as_ref().unwrap_or(&g.dst);
    // The kernel the backend picks for d (the float4 one for multiples of 4).
    let (kernel, cfg) = csr_kernel("test", n_rows, d).unwrap();
    launch!(
        emu,
        kernel,
        cfg,
        (
            *const u64,
            *const u32,
            *const f32,
            *const f32,
            i32,
            *const f32,
            i32,
            *const f32,
            u64,
            u64,
            *mut f32
        ),
        g.offsets.as_ptr(),
        g.indices.as_ptr(),
        g.dst.as_ptr(),
        src.as_ptr(),
        g.src.is_some() as i32,
        slf.as_ptr(),
        g.self_.is_some() as i32,
        x.as_ptr(),
        n_rows as u64,
        d as u64,
        out.as_mut_ptr(),
    );
}

fn host_fwd(g: &BlockGraph) -> ScaledCsr {
    ScaledCsr {
        offsets: g.offsets.clone(),
        indices: g.indices.clone(),
        dst: g.dst_scale.clone(),
        src: g.src_scale.clone(),
        self_: g.self_scale.clone(),
    }
}

fn check_gemm_mapping(cpu: &CpuBackend) {
    for (m, n, k) in [(7usize, 5usize, 9usize), (3, 11, 4), (1, 6, 2)] {
        for ta in [false, true] {
            for tb in [false, true] {
                let a = rnd(m * k, 1);
                let b = rnd(k * n, 2);
                let c0 = rnd(m * n, 3);
                let mut want = c0.clone();
                cpu.gemm(ta, tb, m, n, k, 1.5, &a, &b, 0.5, &mut want)
                    .unwrap();
                // The mapping of CudaBackend::gemm: C^T = op(B)^T op(A)^T, column-major.
                let (op_b, ldb) = if tb { (true, k) } else { (false, n) };
                let (op_a, lda) = if ta { (true, m) } else { (false, k) };
                let mut got = c0.clone();
                colmajor_sgemm(op_b, op_a, n, m, k, 1.5, &b, ldb, &a, lda, 0.5, &mut got, n);
                close(&format!("gemm mapping {m}x{n}x{k} {ta} {tb}"), &want, &got);
            }
        }
    }
}

fn check_aggregation(emu: &Emu, cpu: &CpuBackend) {
    let mut r = ChaCha8Rng::seed_from_u64(10);
    let pairs: Vec<(u32, u32)> = (0..400)
        .map(|_| (r.gen_range(0..60u32), r.gen_range(0..60u32)))
        .collect();
    let graph = grandis_store::graph_from_edges(60, pairs, EdgeOptions::default()).unwrap();
    for agg in [Aggregation::Mean, Aggregation::Sum, Aggregation::Gcn] {
        let dst: Vec<u32> = (0..60).filter(|v| v % 3 == 1).collect();
        let mut src = dst.clone();
        for &v in &dst {
            for &u in graph.view().neighbors(v) {
                if !src.contains(&u) {
                    src.push(u);
                }
            }
        }
        let part = sub_block(graph.view(), &global_scales(graph.view(), agg), &dst, &src).unwrap();
        let full = full_block(graph.view(), agg);
        for d in [1usize, 4, 5, 33, 100, 130, 256] {
            for (label, blk) in [("full", &full), ("block", &part)] {
                let name = format!("{agg:?} {label} d={d}");
                let cg = cpu.upload_graph(blk).unwrap();
                let x = rnd(blk.n_src * d, 11);
                let mut want = vec![0.0; blk.n_dst * d];
                cpu.aggregate(&cg, &x, d, &mut want).unwrap();
                let mut got = vec![f32::NAN; blk.n_dst * d];
                run_csr(emu, &host_fwd(blk), &x, d, &mut got);
                bits(&format!("aggregate {name}"), &want, &got);

                let go = rnd(blk.n_dst * d, 12);
                let mut want = vec![0.0; blk.n_src * d];
                cpu.aggregate_backward(&cg, &go, d, &mut want).unwrap();
                let mut got = vec![f32::NAN; blk.n_src * d];
                run_csr(emu, &crate::block::transpose(blk), &go, d, &mut got);
                bits(&format!("aggregate_backward {name}"), &want, &got);
            }
        }
    }
}

fn check_elementwise(emu: &Emu, cpu: &CpuBackend) {
    let n = 3001usize;
    let n64 = n as u64;
    let x = rnd(n, 13);
    let y0 = rnd(n, 14);
    let mut want = vec![0.0; n];
    cpu.relu(&x, &mut want, n).unwrap();
    let mut got = vec![0.0; n];
    launch!(
        emu,
        "relu_fwd",
        elem_cfg(n64),
        (*const f32, *mut f32, u64),
        x.as_ptr(),
        got.as_mut_ptr(),
        n64
    );
    bits("relu", &want, &got);

    let mut want = y0.clone();
    cpu.relu_backward(&x, &mut want, n).unwrap();
    let mut got = y0.clone();
    launch!(
        emu,
        "relu_bwd",
        elem_cfg(n64),
        (*const f32, *mut f32, u64),
        x.as_ptr(),
        got.as_mut_ptr(),
        n64
    );
    bits("relu_backward", &want, &got);

    let mut want = y0.clone();
    cpu.axpy(0.37, &x, &mut want, n).unwrap();
    let mut got = y0.clone();
    launch!(
        emu,
        "axpy_f32",
        elem_cfg(n64),
        (*const f32, *mut f32, u64, f32),
        x.as_ptr(),
        got.as_mut_ptr(),
        n64,
        0.37
    );
    bits("axpy", &want, &got);

    let mut want = y0.clone();
    cpu.scale(&mut want, -1.7, n).unwrap();
    let mut got = y0.clone();
    launch!(
        emu,
        "scale_f32",
        elem_cfg(n64),
        (*mut f32, u64, f32),
        got.as_mut_ptr(),
        n64,
        -1.7
    );
    bits("scale", &want, &got);

    let mut want = y0.clone();
    cpu.fill(&mut want, n - 5, 2.5).unwrap();
    let mut got = y0.clone();
    launch!(
        emu,
        "fill_f32",
        elem_cfg(n64 - 5),
        (*mut f32, u64, f32),
        got.as_mut_ptr(),
        n64 - 5,
        2.5
    );
    bits("fill", &want, &got);

    for (rows, cols) in [(5usize, 3usize), (1000, 7)] {
        let x = rnd(rows * cols, 4);
        let bias = rnd(cols, 5);
        let mut want = x.clone();
        cpu.add_bias(&mut want, &bias, rows, cols).unwrap();
        // The backend's shape, and a grid of 3 blocks that must stride over the rows.
        let full = rows_cfg(rows as u64, cols as u64);
        let strided = LaunchConfig {
            grid_dim: (3, 1, 1),
            ..full
        };
        for cfg in [full, strided] {
            let mut got = x.clone();
            launch!(
                emu,
                "add_bias",
                cfg,
                (*mut f32, *const f32, u64, u64),
                got.as_mut_ptr(),
                bias.as_ptr(),
                rows as u64,
                cols as u64
            );
            bits("add_bias", &want, &got);
        }
        let mut relu = vec![0.0; rows * cols];
        cpu.relu(&want, &mut relu, rows * cols).unwrap();
        let mut got = vec![f32::NAN; rows * cols];
        launch!(
            emu,
            "bias_relu",
            rows_cfg(rows as u64, cols as u64),
            (*const f32, *const f32, *mut f32, u64, u64),
            x.as_ptr(),
            bias.as_ptr(),
            got.as_mut_ptr(),
            rows as u64,
            cols as u64
        );
        bits("bias_relu", &relu, &got);
    }
}

fn check_dropout(emu: &Emu, cpu: &CpuBackend) {
    let (rows, cols) = (45usize, 67usize);
    let ids: Vec<u32> = (0..rows as u32)
        .map(|i| if i % 2 == 0 { i * 7919 } else { u32::MAX - i })
        .collect();
    let key = DropoutKey {
        seed: 0xdead_beef_1234,
        epoch: 17,
        layer: 3,
    };
    let cfg = rows_cfg(rows as u64, cols as u64);
    for p in [0.0f32, 0.1, 0.5, 0.9] {
        let x = rnd(rows * cols, 15);
        let (thr, scale) = (dropout_threshold(p), 1.0f32 / (1.0 - p));
        let mut want = vec![0.0; rows * cols];
        cpu.dropout(&x, &mut want, rows, cols, &ids, p, key)
            .unwrap();
        let mut got = vec![0.0; rows * cols];
        launch!(
            emu,
            "dropout_fwd",
            cfg,
            (
                *const f32,
                *mut f32,
                u64,
                u64,
                *const u32,
                u64,
                u32,
                f32,
                i32
            ),
            x.as_ptr(),
            got.as_mut_ptr(),
            rows as u64,
            cols as u64,
            ids.as_ptr(),
            key.stream(),
            thr,
            scale,
            (p == 0.0) as i32,
        );
        bits(&format!("dropout p={p}"), &want, &got);
        if p > 0.0 {
            let mut want = x.clone();
            cpu.dropout_backward(&mut want, rows, cols, &ids, p, key)
                .unwrap();
            let mut got = x.clone();
            launch!(
                emu,
                "dropout_bwd",
                cfg,
                (*mut f32, u64, u64, *const u32, u64, u32, f32),
                got.as_mut_ptr(),
                rows as u64,
                cols as u64,
                ids.as_ptr(),
                key.stream(),
                thr,
                scale,
            );
            bits(&format!("dropout_backward p={p}"), &want, &got);
        }
    }
}

#[allow(clippy::too_many_arguments)]
fn finish(
    emu: &Emu,
    part: &[f64],
    n_chunks: u64,
    stride: u64,
    offset: u64,
    cols: u64,
    beta: f32,
    out: &mut [f32],
) {
    launch!(
        emu,
        "partials_finish",
        elem_cfg(cols),
        (*const f64, u64, u64, u64, u64, f32, *mut f32),
        part.as_ptr(),
        n_chunks,
        stride,
        offset,
        cols,
        beta,
        out.as_mut_ptr(),
    );
}

fn check_reductions(emu: &Emu, cpu: &CpuBackend) {
    // 9000 rows: three chunks of RED_CHUNK rows.
    for (rows, cols) in [(5usize, 3usize), (9000, 7), (0, 4)] {
        let x = rnd(rows * cols, 4);
        let (r64, c64) = (rows as u64, cols as u64);
        let n_chunks = r64.div_ceil(kernels::RED_CHUNK);
        let mut part = vec![0.0f64; ((n_chunks * c64) as usize).max(1)];
        if n_chunks > 0 {
            launch!(
                emu,
                "col_partials",
                col_chunks_cfg(c64, n_chunks),
                (*const f32, u64, u64, u64, u64, *mut f64),
                x.as_ptr(),
                r64,
                c64,
                kernels::RED_CHUNK,
                n_chunks,
                part.as_mut_ptr(),
            );
        }
        for beta in [0.0f32, 1.0, 0.25] {
            let init = rnd(cols, 6);
            let mut want = init.clone();
            cpu.col_sum(&x, rows, cols, beta, &mut want).unwrap();
            let mut got = init.clone();
            finish(emu, &part, n_chunks, c64, 0, c64, beta, &mut got);
            bits(&format!("col_sum {rows}x{cols} beta={beta}"), &want, &got);
        }
    }

    for n in [1usize, 1000, 70_000] {
        let x = rnd(n, 24);
        let want = cpu.sum_squares(&x, n).unwrap();
        let n_chunks = (n as u64).div_ceil(kernels::ELEM_CHUNK);
        let mut part = vec![0.0f64; n_chunks as usize];
        launch!(
            emu,
            "sumsq_partials",
            sumsq_cfg(n_chunks),
            (*const f32, u64, u64, u64, *mut f64),
            x.as_ptr(),
            n as u64,
            kernels::ELEM_CHUNK,
            n_chunks,
            part.as_mut_ptr(),
        );
        let got: f64 = part.iter().sum();
        assert!(
            (want - got).abs() <= 1e-12 * want.max(1.0),
            "sum_squares n={n}: cpu {want}, emulated {got}"
        );
    }
}

fn check_gather_scatter(emu: &Emu, cpu: &CpuBackend) {
    let cols = 5usize;
    let src = rnd(20 * cols, 7);
    let ids: Vec<u32> = vec![3, 19, 0, 3, 7, 7, 7, 12];
    let rows = ids.len() as u64;
    let mut want = vec![0.0; ids.len() * cols];
    cpu.gather_rows(&src, cols, &ids, &mut want).unwrap();
    let mut got = vec![0.0; ids.len() * cols];
    launch!(
        emu,
        "gather_rows",
        rows_cfg(rows, cols as u64),
        (*const f32, *const u32, *mut f32, u64, u64),
        src.as_ptr(),
        ids.as_ptr(),
        got.as_mut_ptr(),
        rows,
        cols as u64,
    );
    bits("gather_rows", &want, &got);

    let contrib = rnd(ids.len() * cols, 8);
    let base = rnd(20 * cols, 9);
    let mut want = base.clone();
    cpu.scatter_add_rows(&contrib, cols, &ids, &mut want)
        .unwrap();
    let (targets, offsets, positions) = scatter_groups(&ids);
    assert_eq!(targets, vec![0, 3, 7, 12, 19]);
    assert_eq!(offsets, vec![0, 1, 3, 6, 7, 8]);
    assert_eq!(positions, vec![2, 0, 3, 4, 5, 6, 7, 1]);
    let ng = targets.len() as u64;
    let mut got = base.clone();
    launch!(
        emu,
        "scatter_add_grouped",
        rows_cfg(ng, cols as u64),
        (
            *const f32,
            *const u32,
            *const u64,
            *const u32,
            *mut f32,
            u64,
            u64
        ),
        contrib.as_ptr(),
        targets.as_ptr(),
        offsets.as_ptr(),
        positions.as_ptr(),
        got.as_mut_ptr(),
        ng,
        cols as u64,
    );
    bits("scatter_add_rows", &want, &got);
    assert_eq!(scatter_groups(&[]), (vec![], vec![0], vec![]));
}

fn check_layer_norm(emu: &Emu, cpu: &CpuBackend) {
    for (rows, cols) in [(3usize, 1usize), (20, 16), (9, 100)] {
        let x: Vec<f32> = rnd(rows * cols, 16).iter().map(|v| v * 3.0 + 0.5).collect();
        let gamma = rnd(cols, 17);
        let beta = rnd(cols, 18);
        let (r64, c64) = (rows as u64, cols as u64);
        let mut out = vec![0.0; rows * cols];
        let (mut mean, mut rstd) = (vec![0.0; rows], vec![0.0; rows]);
        cpu.layer_norm(
            &x, &gamma, &beta, rows, cols, 1e-5, &mut out, &mut mean, &mut rstd,
        )
        .unwrap();
        let mut o2 = vec![0.0; rows * cols];
        let (mut m2, mut s2) = (vec![0.0; rows], vec![0.0; rows]);
        launch!(
            emu,
            "layer_norm_fwd",
            warp_rows_cfg("test", r64).unwrap(),
            (
                *const f32,
                *const f32,
                *const f32,
                u64,
                u64,
                f32,
                *mut f32,
                *mut f32,
                *mut f32
            ),
            x.as_ptr(),
            gamma.as_ptr(),
            beta.as_ptr(),
            r64,
            c64,
            1e-5,
            o2.as_mut_ptr(),
            m2.as_mut_ptr(),
            s2.as_mut_ptr(),
        );
        close("layer_norm out", &out, &o2);
        close("layer_norm mean", &mean, &m2);
        close("layer_norm rstd", &rstd, &s2);

        let gy = rnd(rows * cols, 19);
        let (g0, b0) = (rnd(cols, 20), rnd(cols, 21));
        let mut dx = vec![0.0; rows * cols];
        let (mut dg, mut db) = (g0.clone(), b0.clone());
        cpu.layer_norm_backward(
            &gy, &x, &gamma, &mean, &rstd, rows, cols, &mut dx, &mut dg, &mut db,
        )
        .unwrap();
        let mut dx2 = vec![0.0; rows * cols];
        let (mut dg2, mut db2) = (g0.clone(), b0.clone());
        launch!(
            emu,
            "layer_norm_bwd_x",
            warp_rows_cfg("test", r64).unwrap(),
            (
                *const f32,
                *const f32,
                *const f32,
                *const f32,
                *const f32,
                u64,
                u64,
                *mut f32
            ),
            gy.as_ptr(),
            x.as_ptr(),
            gamma.as_ptr(),
            mean.as_ptr(),
            rstd.as_ptr(),
            r64,
            c64,
            dx2.as_mut_ptr(),
        );
        let n_chunks = r64.div_ceil(kernels::RED_CHUNK);
        let mut part = vec![0.0f64; (n_chunks * 2 * c64) as usize];
        launch!(
            emu,
            "layer_norm_param_partials",
            col_chunks_cfg(c64, n_chunks),
            (
                *const f32,
                *const f32,
                *const f32,
                *const f32,
                u64,
                u64,
                u64,
                u64,
                *mut f64
            ),
            gy.as_ptr(),
            x.as_ptr(),
            mean.as_ptr(),
            rstd.as_ptr(),
            r64,
            c64,
            kernels::RED_CHUNK,
            n_chunks,
            part.as_mut_ptr(),
        );
        finish(emu, &part, n_chunks, 2 * c64, 0, c64, 1.0, &mut dg2);
        finish(emu, &part, n_chunks, 2 * c64, c64, c64, 1.0, &mut db2);
        close("layer_norm grad_x", &dx, &dx2);
        bits("layer_norm grad_gamma", &dg, &dg2);
        bits("layer_norm grad_beta", &db, &db2);
    }
}

fn check_cross_entropy(emu: &Emu, cpu: &CpuBackend) {
    for (n, classes) in [(10usize, 3usize), (30, 47)] {
        let logits: Vec<f32> = rnd(n * classes, 22).iter().map(|v| v * 4.0).collect();
        let rows: Vec<u32> = (0..n as u32).filter(|r| r % 3 != 2).collect();
        let mut r = ChaCha8Rng::seed_from_u64(23);
        let labels: Vec<u32> = rows
            .iter()
            .map(|_| r.gen_range(0..classes as u32))
            .collect();
        let mut want = vec![0.0; n * classes];
        let loss = cpu
            .cross_entropy(&logits, n, classes, &rows, &labels, 123.0, &mut want)
            .unwrap();
        let mut got = vec![0.0; n * classes];
        let mut terms = vec![0.0f64; rows.len()];
        launch!(
            emu,
            "xent_rows",
            warp_rows_cfg("test", rows.len() as u64).unwrap(),
            (
                *const f32,
                u64,
                *const u32,
                *const u32,
                u64,
                f32,
                *mut f32,
                *mut f64
            ),
            logits.as_ptr(),
            classes as u64,
            rows.as_ptr(),
            labels.as_ptr(),
            rows.len() as u64,
            1.0f32 / 123.0,
            got.as_mut_ptr(),
            terms.as_mut_ptr(),
        );
        let total: f64 = terms.iter().sum();
        assert!(
            (loss - total).abs() <= 1e-9 * loss.abs().max(1.0),
            "cross_entropy loss: cpu {loss}, emulated {total}"
        );
        close("cross_entropy grad", &want, &got);
    }
}

fn check_adam(emu: &Emu, cpu: &CpuBackend) {
    let n = 3001usize;
    for decoupled in [false, true] {
        let mut w = rnd(n, 25);
        let (mut m, mut v) = (vec![0.0; n], vec![0.0; n]);
        let (mut w2, mut m2, mut v2) = (w.clone(), m.clone(), v.clone());
        for step in 1..=5u64 {
            let grad = rnd(n, 100 + step);
            let s = AdamStep {
                weight_decay: 0.05,
                decoupled,
                grad_scale: 0.7,
                ..AdamStep::new(0.01, step)
            };
            cpu.adam_step(&mut w, &grad, &mut m, &mut v, n, &s).unwrap();
            let (bc1, bc2) = s.bias_corrections();
            launch!(
                emu,
                "adam_step",
                elem_cfg(n as u64),
                (
                    *mut f32,
                    *const f32,
                    *mut f32,
                    *mut f32,
                    u64,
                    f32,
                    f32,
                    f32,
                    f32,
                    f32,
                    i32,
                    f32,
                    f32,
                    f32
                ),
                w2.as_mut_ptr(),
                grad.as_ptr(),
                m2.as_mut_ptr(),
                v2.as_mut_ptr(),
                n as u64,
                s.lr,
                s.beta1,
                s.beta2,
                s.eps,
                s.weight_decay,
                decoupled as i32,
                s.grad_scale,
                bc1,
                bc2,
            );
        }
        bits("adam param", &w, &w2);
        bits("adam m", &m, &m2);
        bits("adam v", &v, &v2);
    }
}

/// GAT's three kernels against the CPU backend, on a block with a halo, self-loops and
/// repeated edges, with and without attention dropout, heads concatenated and averaged, with
/// self-loops added and without (a destination with no source among them).
fn check_attention(emu: &Emu, cpu: &CpuBackend) {
    let mut r = ChaCha8Rng::seed_from_u64(20);
    let mut pairs: Vec<(u32, u32)> = (0..300)
        .map(|_| (r.gen_range(0..50u32), r.gen_range(0..50u32)))
        .collect();
    pairs.extend((0..50u32).step_by(4).map(|v| (v, v)));
    // Vertex 0 keeps only its self-loop and vertex 2 has no edge: without self-loops added,
    // one destination attends to itself alone and one to nothing.
    pairs.retain(|&(a, b)| (a != 0 || b == 0) && (b != 0 || a == 0) && a != 2 && b != 2);
    let graph = grandis_store::graph_from_edges(50, pairs, EdgeOptions::default()).unwrap();
    let dst: Vec<u32> = (0..50).filter(|v| v % 2 == 0).collect();
    let mut src = dst.clone();
    for &v in &dst {
        for &u in graph.view().neighbors(v) {
            if !src.contains(&u) {
                src.push(u);
            }
        }
    }
    let scales = global_scales(graph.view(), Aggregation::Mean);
    let blk = sub_block(graph.view(), &scales, &dst, &src).unwrap();
    let cg = cpu.upload_graph(&blk).unwrap();
    let (fwd, bwd) = (host_fwd(&blk), crate::block::transpose(&blk));
    let (n_dst, n_src) = (blk.n_dst, blk.n_src);
    let cases = [
        (3usize, 5usize, true, Some(0.4f32), true),
        (2, 4, false, None, true),
        (2, 3, true, Some(0.3), false),
        (3, 2, false, None, false),
    ];
    for (heads, f, concat, p, self_loops) in cases {
        let name =
            format!("attention heads {heads} concat {concat} p {p:?} self-loops {self_loops}");
        let key = DropoutKey {
            seed: 5,
            epoch: 2,
            layer: 9,
        };
        let att = Attention {
            heads,
            head_dim: f,
            concat,
            negative_slope: 0.2,
            self_loops,
            dropout: p.map(|p| AttentionDropout {
                global_ids: &src,
                p,
                key,
            }),
        };
        let (c, oc, two_h) = (heads * f, att.out_cols(), 2 * heads);
        let x = rnd(n_src * c, 21);
        let sc = rnd(n_src * two_h, 22);
        let go = rnd(n_dst * oc, 23);
        let mut want = (vec![0.0; n_dst * oc], vec![0.0; n_dst * heads]);
        cpu.attention_aggregate(&cg, &x, &sc, &att, &mut want.0, &mut want.1)
            .unwrap();
        let mut want_g = (
            vec![0.0; n_src * c],
            vec![0.0; n_src * two_h],
            vec![0.0; n_dst * heads],
        );
        cpu.attention_aggregate_backward(
            &cg,
            &x,
            &sc,
            &want.1,
            &att,
            &go,
            &mut want_g.0,
            &mut want_g.1,
            &mut want_g.2,
        )
        .unwrap();
        // The kernels' dropout arguments, as `AttnArgs` resolves them.
        let has_drop = att.dropout.is_some() as i32;
        let (stream, thr, scale) = att
            .dropout
            .as_ref()
            .map_or((0, 0, 1.0), |d| d.mask_constants());
        let (h64, f64_, cc) = (heads as u64, f as u64, concat as i32);
        let mut out = vec![f32::NAN; n_dst * oc];
        let mut lse = vec![f32::NAN; n_dst * heads];
        launch!(
            emu,
            "gat_fwd",
            elem_cfg(n_dst as u64),
            (
                *const u64,
                *const u32,
                *const f32,
                *const f32,
                u64,
                u64,
                i32,
                f32,
                i32,
                i32,
                *const u32,
                u64,
                u32,
                f32,
                u64,
                *mut f32,
                *mut f32
            ),
            fwd.offsets.as_ptr(),
            fwd.indices.as_ptr(),
            x.as_ptr(),
            sc.as_ptr(),
            h64,
            f64_,
            cc,
            0.2f32,
            self_loops as i32,
            has_drop,
            src.as_ptr(),
            stream,
            thr,
            scale,
            n_dst as u64,
            out.as_mut_ptr(),
            lse.as_mut_ptr(),
        );
        bits(&format!("{name} out"), &want.0, &out);
        bits(&format!("{name} lse"), &want.1, &lse);
        let mut gx = vec![f32::NAN; n_src * c];
        let mut gs = vec![f32::NAN; n_src * two_h];
        let mut scratch = vec![f32::NAN; n_dst * heads];
        launch!(
            emu,
            "gat_bwd_dst",
            elem_cfg(n_dst as u64),
            (
                *const u64,
                *const u32,
                *const f32,
                *const f32,
                *const f32,
                *const f32,
                u64,
                u64,
                i32,
                f32,
                i32,
                i32,
                *const u32,
                u64,
                u32,
                f32,
                u64,
                *mut f32,
                *mut f32
            ),
            fwd.offsets.as_ptr(),
            fwd.indices.as_ptr(),
            x.as_ptr(),
            sc.as_ptr(),
            lse.as_ptr(),
            go.as_ptr(),
            h64,
            f64_,
            cc,
            0.2f32,
            self_loops as i32,
            has_drop,
            src.as_ptr(),
            stream,
            thr,
            scale,
            n_dst as u64,
            gs.as_mut_ptr(),
            scratch.as_mut_ptr(),
        );
        launch!(
            emu,
            "gat_bwd_src",
            elem_cfg(n_src as u64),
            (
                *const u64,
                *const u32,
                *const f32,
                *const f32,
                *const f32,
                *const f32,
                *const f32,
                u64,
                u64,
                i32,
                f32,
                i32,
                i32,
                *const u32,
                u64,
                u32,
                f32,
                u64,
                u64,
                *mut f32,
                *mut f32
            ),
            bwd.offsets.as_ptr(),
            bwd.indices.as_ptr(),
            x.as_ptr(),
            sc.as_ptr(),
            lse.as_ptr(),
            go.as_ptr(),
            scratch.as_ptr(),
            h64,
            f64_,
            cc,
            0.2f32,
            self_loops as i32,
            has_drop,
            src.as_ptr(),
            stream,
            thr,
            scale,
            n_dst as u64,
            n_src as u64,
            gx.as_mut_ptr(),
            gs.as_mut_ptr(),
        );
        bits(&format!("{name} grad_x"), &want_g.0, &gx);
        bits(&format!("{name} grad_scores"), &want_g.1, &gs);
        bits(&format!("{name} scratch"), &want_g.2, &scratch);
    }
}

/// One test for all kernels: the emulator's launch state is global (not re-entrant).
#[test]
fn kernels_match_cpu_backend_under_host_emulation() {
    let cpu = CpuBackend::new(Some(2)).unwrap();
    check_gemm_mapping(&cpu);
    let Some(emu) = Emu::build() else { return };
    check_aggregation(&emu, &cpu);
    check_elementwise(&emu, &cpu);
    check_dropout(&emu, &cpu);
    check_reductions(&emu, &cpu);
    check_gather_scatter(&emu, &cpu);
    check_layer_norm(&emu, &cpu);
    check_cross_entropy(&emu, &cpu);
    check_adam(&emu, &cpu);
    check_attention(&emu, &cpu);
}
