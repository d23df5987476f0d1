//! Partition quality, computed on the relabelled graph where every part is a contiguous id
//! range (so "which part is v in" is a comparison, and halos are per-range scans).

use grandis_store::CsrView;
use rayon::prelude::*;

/// How good a two-level partition is. Cuts count undirected edges: an unordered pair {u, v}
/// joined by at least one stored edge counts once.
#[derive(Debug, Clone, PartialEq, serde::Serialize, serde::Deserialize)]
pub struct Quality {
    /// Undirected edges whose endpoints sit on different servers.
    pub inter_server_cut: u64,
    /// Undirected edges between different devices of the same server.
    pub intra_server_cut: u64,
    /// All undirected edges (self-loops excluded), for scale.
    pub undirected_edges: u64,
    /// CATGNN's replication factor over device parts: Σ_p |V_p ∪ halo_p| / |V|, where halo_p
    /// are the vertices outside p with an edge into p (the in-neighbours one GNN layer reads).
    pub replication_factor: f64,
    /// The same over server parts.
    pub server_replication_factor: f64,
    /// Largest part / mean part, over device parts: vertices, stored edges into the part's
    /// vertices (its aggregation work), training vertices.
    pub vertex_balance: f64,
    pub edge_balance: f64,
    pub train_balance: f64,
    /// The same over server parts.
    pub server_vertex_balance: f64,
    pub server_edge_balance: f64,
    pub server_train_balance: f64,
}

use crate::PASS_BLOCK_EDGES;

/// `part_starts`: device parts, server-major (length servers * devices + 1).
/// `train`: sorted training vertex ids (new ids). `release(edges)`: the pass is done with
/// those sources (a no-op for a graph in memory), called after each block so a mapped graph
/// larger than memory is measured with bounded resident memory.
pub(crate) fn measure(
    graph: CsrView<'_>,
    symmetric: bool,
    part_starts: &[u64],
    devices: usize,
    train: &[u32],
    release: &(dyn Fn(std::ops::Range<usize>) + Sync),
) -> Quality {
    let n = graph.num_vertices();
    let parts = part_starts.len() - 1;
    let server_starts: Vec<u64> = part_starts.iter().step_by(devices).copied().collect();
    // part_of / server_of for every vertex: 4 bytes per vertex, cheaper than searching per edge.
    let mut part_of = vec![0u32; n];
    for p in 0..parts {
        part_of[part_starts[p] as usize..part_starts[p + 1] as usize].fill(p as u32);
    }
    let dev = devices as u32;
    let mut counts = (0u64, 0u64, 0u64);
    for rows in graph.row_blocks(0..n, PASS_BLOCK_EDGES) {
        let block = rows
            .clone()
            .into_par_iter()
            .map(|dst| {
                let dst = dst as u32;
                let mut acc = (0u64, 0u64, 0u64);
                for &src in graph.neighbors(dst) {
                    if src == dst {
                        continue;
                    }
                    // Count each unordered pair once: from its smaller end, or from the only
                    // direction that exists.
                    let counted = src < dst || (!symmetric && !graph.has_edge(dst, src));
                    if !counted {
                        continue;
                    }
                    acc.2 += 1;
                    let (ps, pd) = (part_of[src as usize], part_of[dst as usize]);
                    if ps / dev != pd / dev {
                        acc.0 += 1;
                    } else if ps != pd {
                        acc.1 += 1;
                    }
                }
                acc
            })
            .reduce(|| (0, 0, 0), |a, b| (a.0 + b.0, a.1 + b.1, a.2 + b.2));
        counts = (counts.0 + block.0, counts.1 + block.1, counts.2 + block.2);
        release(graph.offsets[rows.start] as usize..graph.offsets[rows.end] as usize);
    }
    let (inter, intra, total) = counts;
    drop(part_of);

    let train_in = |a: u64, b: u64| -> u64 {
        let lo = train.partition_point(|&v| (v as u64) < a);
        let hi = train.partition_point(|&v| (v as u64) < b);
        (hi - lo) as u64
    };
    let balance = |starts: &[u64], f: &dyn Fn(u64, u64) -> u64| -> f64 {
        let values: Vec<u64> = starts.windows(2).map(|w| f(w[0], w[1])).collect();
        let total: u64 = values.iter().sum();
        if total == 0 {
            return 1.0;
        }
        let max = *values.iter().max().unwrap_or(&0);
        max as f64 * values.len() as f64 / total as f64
    };
    let vertices = |a: u64, b: u64| b - a;
    let edges = |a: u64, b: u64| graph.offsets[b as usize] - graph.offsets[a as usize];
    Quality {
        inter_server_cut: inter,
        intra_server_cut: intra,
        undirected_edges: total,
        replication_factor: replication(graph, part_starts, release),
        server_replication_factor: replication(graph, &server_starts, release),
        vertex_balance: balance(part_starts, &vertices),
        edge_balance: balance(part_starts, &edges),
        train_balance: balance(part_starts, &train_in),
        server_vertex_balance: balance(&server_starts, &vertices),
        server_edge_balance: balance(&server_starts, &edges),
        server_train_balance: balance(&server_starts, &train_in),
    }
}

/// Σ_p |V_p ∪ halo_p| / |V| for contiguous parts: one pass over the rows in order, with one
/// bitmap of |V| bits for the part being scanned.
fn replication(
    graph: CsrView<'_>,
    starts: &[u64],
    release: &(dyn Fn(std::ops::Range<usize>) + Sync),
) -> f64 {
    use std::sync::atomic::{AtomicU64, Ordering};
    let n = graph.num_vertices();
    if n == 0 {
        return 1.0;
    }
    let seen: Vec<AtomicU64> = (0..n.div_ceil(64)).map(|_| AtomicU64::new(0)).collect();
    let mut total = 0u64;
    for w in starts.windows(2) {
        let (a, b) = (w[0] as u32, w[1] as u32);
        seen.par_iter()
            .for_each(|word| word.store(0, Ordering::Relaxed));
        let mut halo = 0u64;
        for rows in graph.row_blocks(a as usize..b as usize, PASS_BLOCK_EDGES) {
            halo += rows
                .clone()
                .into_par_iter()
                .map(|dst| {
                    let mut fresh = 0u64;
                    for &src in graph.neighbors(dst as u32) {
                        if src < a || src >= b {
                            let (word, bit) = (src as usize / 64, 1u64 << (src % 64));
                            if seen[word].fetch_or(bit, Ordering::Relaxed) & bit == 0 {
                                fresh += 1;
                            }
                        }
                    }
                    fresh
                })
                .sum::<u64>();
            release(graph.offsets[rows.start] as usize..graph.offsets[rows.end] as usize);
        }
        total += (b - a) as u64 + halo;
    }
    total as f64 / n as f64
}
