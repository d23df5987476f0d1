//! What the engine's test files share: random inputs, a random graph, the CPU backend and a
//! block with halo rows.

#![allow(dead_code)]

use grandis_engine::norm::{global_scales, sub_block, Aggregation};
use grandis_engine::{BlockGraph, CpuBackend};
use grandis_store::{CsrGraph, EdgeOptions};
use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;

/// `n` values uniform in `[-1, 1)`.
pub fn rnd(n: usize, seed: u64) -> Vec<f32> {
    let mut r = ChaCha8Rng::seed_from_u64(seed);
    (0..n).map(|_| r.gen_range(-1.0f32..1.0)).collect()
}

pub fn cpu() -> CpuBackend {
    CpuBackend::new(Some(2)).unwrap()
}

/// `edges` directed edges drawn uniformly among `n` vertices.
pub fn random_graph(n: usize, edges: usize, seed: u64) -> CsrGraph {
    let mut r = ChaCha8Rng::seed_from_u64(seed);
    let pairs: Vec<(u32, u32)> = (0..edges)
        .map(|_| (r.gen_range(0..n as u32), r.gen_range(0..n as u32)))
        .collect();
    grandis_store::graph_from_edges(n as u64, pairs, EdgeOptions::default()).unwrap()
}

/// The block of a device owning every third vertex (`v % 3 == 1`): its rows, then as halo
/// every vertex they read. Returns (destinations, sources, block).
pub fn every_third_block(g: &CsrGraph, agg: Aggregation) -> (Vec<u32>, Vec<u32>, BlockGraph) {
    let n = g.offsets.len() as u32 - 1;
    let dst: Vec<u32> = (0..n).filter(|v| v % 3 == 1).collect();
    let mut src = dst.clone();
    for &v in &dst {
        for &u in g.view().neighbors(v) {
            if !src.contains(&u) {
                src.push(u);
            }
        }
    }
    let scales = global_scales(g.view(), agg);
    let blk = sub_block(g.view(), &scales, &dst, &src).unwrap();
    (dst, src, blk)
}
