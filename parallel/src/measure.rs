//! What a server measures of itself when a job starts ([`server_rates`]): one device's compute
//! rate on the job's hidden width (a short calibration of the two kinds of work a layer does,
//! dense products and neighbourhood aggregation, on the backend the ranks will use) and its
//! links ([`grandis_fabric::Endpoint::probe_links`] over the job's own transport). The
//! performance model turns a plan's counts into seconds with them.

use std::time::{Duration, Instant};

use anyhow::Context;
use grandis_engine::{Backend, BlockGraph};
use grandis_fabric::{Endpoint, LinkProbe};
use grandis_wire::{ComputeRate, LinkRate, ServerRates};

use crate::Compute;

/// The largest message of the probe's bandwidth measurement.
pub const PROBE_BYTES: usize = 8 << 20;

/// Bytes of the memory-copy measurement: far beyond any cache.
const COPY_BYTES: usize = 64 << 20;

/// Copies of the memory-copy measurement after a warm-up one; the fastest counts.
const COPY_ROUNDS: usize = 3;

/// How long each half of the compute calibration runs (at least one call).
const CALIBRATION: Duration = Duration::from_millis(100);

/// Rows of the calibration's matrices and graph, and the source rows of its aggregations:
/// within the caches, and far beyond them.
const ROWS: usize = 8192;
pub const CACHED_SOURCE_ROWS: usize = ROWS;
pub const UNCACHED_SOURCE_ROWS: usize = 1 << 18;

/// In-degree of the calibration graph.
pub const DEGREE: usize = 16;

/// Measures one device's compute rate at `width` columns on backend `b`.
pub fn compute_rate<B: Backend>(b: &B, width: usize) -> anyhow::Result<ComputeRate> {
    let width = width.max(1);
    let x = b.upload(&pseudo_random(ROWS * width, 1))?;
    let w = b.upload(&pseudo_random(width * width, 2))?;
    let mut y = b.alloc(ROWS * width)?;
    let gemm_calls = repeat(b, CALIBRATION, || {
        b.gemm(false, false, ROWS, width, width, 1.0, &x, &w, 0.0, &mut y)
    })?;
    let flops = 2.0 * (ROWS * width * width) as f64;
    // Seconds of one aggregation over `ROWS` output rows of `degree` scattered neighbours
    // each among `sources` rows of `cols` columns.
    let aggregation = |sources: usize, degree: usize, cols: usize, time: Duration| {
        let n = ROWS;
        let graph = BlockGraph {
            n_dst: n,
            n_src: sources,
            offsets: (0..=n).map(|v| (v * degree) as u64).collect(),
            // A scattered neighbourhood, as a partitioned graph's is.
            indices: (0..n * degree)
                .map(|e| ((e as u64).wrapping_mul(2654435761) % sources as u64) as u32)
                .collect(),
            dst_scale: vec![1.0 / degree.max(1) as f32; n],
            src_scale: None,
            self_scale: None,
        };
        let g = b.upload_graph(&graph)?;
        let src = b.upload(&pseudo_random(sources * cols, 3))?;
        let mut out = b.alloc(n * cols)?;
        let calls = repeat(b, time, || b.aggregate(&g, &src, cols, &mut out))?;
        anyhow::Ok(calls.1 / calls.0 as f64)
    };
    let edge_cols = (ROWS * DEGREE * width) as f64;
    let cached = aggregation(CACHED_SOURCE_ROWS, DEGREE, width, CALIBRATION)?;
    let uncached = aggregation(UNCACHED_SOURCE_ROWS, DEGREE, width, CALIBRATION)?;
    let rows = aggregation(CACHED_SOURCE_ROWS, 0, width, CALIBRATION / 2)?;
    Ok(ComputeRate {
        gemm_flops_per_s: flops * gemm_calls.0 as f64 / gemm_calls.1,
        aggregation_edge_cols_per_s: edge_cols / cached,
        aggregation_uncached_edge_cols_per_s: edge_cols / uncached,
        width,
        aggregation_row_edges: row_edges(cached, rows),
    })
}

/// [`ComputeRate::aggregation_row_edges`] from a pass over `ROWS` rows of `DEGREE` edges each
/// (`seconds`) and one over as many rows without edges (`rows_only`). Timing noise can put
/// the edges at nothing: then the rows are not priced apart.
fn row_edges(seconds: f64, rows_only: f64) -> f64 {
    let per_edge = (seconds - rows_only) / DEGREE as f64;
    match per_edge > 0.0 && rows_only > 0.0 {
        true => rows_only / per_edge,
        false => 0.0,
    }
}

/// This host's memory-copy rate: bytes per second of the fastest of a few copies of
/// [`COPY_BYTES`] (the source written first, so its pages are real).
pub fn memory_copy_rate() -> f64 {
    let src: Vec<u8> = (0..COPY_BYTES).map(|i| i as u8).collect();
    let mut dst = vec![0u8; COPY_BYTES];
    dst.copy_from_slice(&src);
    let mut best = f64::INFINITY;
    for _ in 0..COPY_ROUNDS {
        let start = Instant::now();
        dst.copy_from_slice(std::hint::black_box(&src));
        std::hint::black_box(&mut dst);
        best = best.min(start.elapsed().as_secs_f64());
    }
    COPY_BYTES as f64 / best.max(1e-9)
}

/// Calls `f` until `time` has passed (after one warm-up call): (calls, seconds).
fn repeat<B: Backend>(
    b: &B,
    time: Duration,
    mut f: impl FnMut() -> grandis_engine::Result<()>,
) -> anyhow::Result<(usize, f64)> {
    f()?;
    b.synchronize()?;
    let start = Instant::now();
    let mut calls = 0;
    while calls == 0 || start.elapsed() < time {
        f()?;
        calls += 1;
        if calls % 4 == 0 {
            b.synchronize()?;
        }
    }
    b.synchronize()?;
    Ok((calls, start.elapsed().as_secs_f64()))
}

fn pseudo_random(len: usize, seed: u64) -> Vec<f32> {
    let mut s = seed.wrapping_mul(0x9e37_79b9_7f4a_7c15) | 1;
    (0..len)
        .map(|_| {
            s ^= s << 13;
            s ^= s >> 7;
            s ^= s << 17;
            (s >> 40) as f32 / (1u64 << 24) as f32 - 0.5
        })
        .collect()
}

/// Measures this server: its links over `endpoints` (this server's ranks, which must all be
/// here; every other server of the job must measure at the same time) and one device's
/// compute on `compute` at `width` columns, with `threads` CPU threads per rank.
pub fn server_rates(
    compute: &Compute,
    threads: usize,
    endpoints: &mut [Endpoint],
    width: usize,
) -> anyhow::Result<ServerRates> {
    let start = Instant::now();
    let probes: Vec<LinkProbe> = std::thread::scope(|scope| {
        let handles: Vec<_> = endpoints
            .iter_mut()
            .map(|ep| scope.spawn(move || ep.probe_links(PROBE_BYTES)))
            .collect();
        handles
            .into_iter()
            .map(|h| match h.join() {
                Ok(r) => r.context("measuring the links"),
                Err(_) => Err(anyhow::anyhow!("a link probe panicked")),
            })
            .collect::<anyhow::Result<Vec<_>>>()
    })?;
    // One device stands for the server's: its first rank's.
    let first = endpoints.first().context("a server without ranks")?;
    let rate = match compute {
        Compute::Cpu => compute_rate(&grandis_engine::CpuBackend::new(Some(threads))?, width)?,
        Compute::Cuda { .. } => {
            compute_rate(&crate::compute::cuda_rank_backend(compute, first)?, width)?
        }
    };
    let copy = memory_copy_rate();
    // Capped at the copy rate: see `ServerRates::memory_copy_bytes_per_s`.
    let mean = |links: Vec<LinkRate>| -> Option<LinkRate> {
        let n = links.len() as f64;
        (!links.is_empty()).then(|| LinkRate {
            bandwidth_bytes_per_s: (links.iter().map(|l| l.bandwidth_bytes_per_s).sum::<f64>() / n)
                .min(copy),
            latency_s: links.iter().map(|l| l.latency_s).sum::<f64>() / n,
        })
    };
    Ok(ServerRates {
        device: compute.name(),
        compute: rate,
        intra: mean(probes.iter().filter_map(|p| p.intra).collect()),
        inter: mean(probes.iter().filter_map(|p| p.inter).collect()),
        seconds: start.elapsed().as_secs_f64(),
        memory_copy_bytes_per_s: copy,
    })
}

/// What a run of every rank in this process measures: its fabric's links (one built as the
/// run builds it, with `popts`' emulated link models) and one rank's compute at the model's
/// hidden width.
pub fn in_process_rates(
    popts: &crate::ParallelOptions,
    layout: &grandis_masking::Layout,
    config: &grandis_models::ModelConfig,
) -> anyhow::Result<ServerRates> {
    let mut endpoints = popts.in_process_endpoints(layout)?;
    server_rates(
        &popts.machine.compute,
        popts.rank_threads(layout.num_ranks()),
        &mut endpoints,
        config.hidden,
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The calibration reports positive rates, and a wider matrix costs more flops per call
    /// (so the rate is per flop, not per call).
    #[test]
    fn calibration_measures_positive_rates() {
        let b = grandis_engine::CpuBackend::new(Some(1)).unwrap();
        let r = compute_rate(&b, 16).unwrap();
        assert!(r.gemm_flops_per_s > 1e6, "{r:?}");
        assert!(r.aggregation_edge_cols_per_s > 1e6, "{r:?}");
        assert_eq!(r.width, 16);
        // A row's write is not free, nor worth the whole pass of 16 edges.
        assert!(
            r.aggregation_row_edges > 0.0 && r.aggregation_row_edges < 64.0,
            "{r:?}"
        );
    }

    /// A row's cost in edges: the rows-only pass over the edges' share of the full one; a
    /// full pass no slower than its rows alone (noise) prices no rows apart.
    #[test]
    fn row_edges_is_the_rows_cost_over_an_edges() {
        // 16 edges of 1 s and a row of 3 s per row.
        assert_eq!(row_edges(19.0, 3.0), 3.0);
        assert_eq!(row_edges(3.0, 3.0), 0.0);
        assert_eq!(row_edges(2.0, 3.0), 0.0);
    }

    /// Two servers of two devices measure their links together; each server's figures come
    /// back with one inter-server rate (its head's) and the mean of its devices' intra ones.
    #[test]
    fn servers_measure_their_links_together() {
        let fabric = grandis_fabric::Fabric::new(grandis_fabric::FabricConfig {
            servers: 2,
            devices: 2,
            ..Default::default()
        })
        .unwrap();
        let mut endpoints = fabric.into_endpoints();
        let second: Vec<Endpoint> = endpoints.split_off(2);
        let (a, b) = std::thread::scope(|s| {
            let h = s.spawn(move || {
                let mut second = second;
                server_rates(&Compute::Cpu, 1, &mut second, 8)
            });
            let a = server_rates(&Compute::Cpu, 1, &mut endpoints, 8);
            (a, h.join().unwrap())
        });
        for r in [a.unwrap(), b.unwrap()] {
            assert!(r.intra.is_some() && r.inter.is_some(), "{r:?}");
            // In-process links hand buffers over without copying: no faster than a copy.
            assert!(r.memory_copy_bytes_per_s > 1e8, "{r:?}");
            for link in [r.intra.unwrap(), r.inter.unwrap()] {
                assert!(
                    link.bandwidth_bytes_per_s <= r.memory_copy_bytes_per_s,
                    "{r:?}"
                );
            }
            assert_eq!(r.device, "cpu");
            assert!(r.compute.gemm_flops_per_s > 0.0);
        }
    }
}
