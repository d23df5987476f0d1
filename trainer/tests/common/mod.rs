//! Graphs (and the CUDA device) the trainer's tests share.
#![allow(dead_code)]

use grandis_store::{CsrGraph, EdgeOptions, SelfLoops};
use rand::Rng;
use rand_chacha::ChaCha8Rng;

/// `grandis_trainer::train` without a checkpoint on `threads` threads, which must succeed.
pub fn train_plain(
    view: grandis_store::DatasetView<'_>,
    config: grandis_models::ModelConfig,
    opts: &grandis_trainer::TrainOptions,
    threads: Option<usize>,
) -> grandis_trainer::TrainReport {
    let ck = grandis_trainer::CheckpointOptions::default();
    grandis_trainer::train(view, config, opts, &ck, threads, |_| {}).unwrap()
}

/// An undirected graph of `n` vertices in `classes` communities (vertex `v` in community
/// `v % classes`): each vertex draws `per_vertex` edges, 90 % of them inside its community;
/// no self-loops.
pub fn community_graph(
    r: &mut ChaCha8Rng,
    n: usize,
    classes: usize,
    per_vertex: usize,
) -> CsrGraph {
    let mut edges = Vec::new();
    for v in 0..n {
        for _ in 0..per_vertex {
            let u = if r.gen_bool(0.9) {
                r.gen_range(0..n / classes) * classes + v % classes
            } else {
                r.gen_range(0..n)
            };
            edges.push((v as u32, u as u32));
        }
    }
    let options = EdgeOptions {
        symmetrize: true,
        self_loops: SelfLoops::Remove,
    };
    grandis_store::graph_from_edges(n as u64, edges, options).unwrap()
}

/// CUDA device 0, or None (with a message saying why the test is skipped) on a machine
/// without an NVIDIA driver or device.
#[cfg(feature = "cuda")]
pub fn cuda_device() -> Option<grandis_engine::cuda::CudaBackend> {
    if !grandis_engine::cuda::driver_library_present() {
        eprintln!("skipped: no CUDA driver on this machine");
        return None;
    }
    match grandis_engine::cuda::CudaBackend::new(0) {
        Ok(b) => Some(b),
        Err(e) => {
            eprintln!("skipped: CUDA device 0 unavailable: {e}");
            None
        }
    }
}
