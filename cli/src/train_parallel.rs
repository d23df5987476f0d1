//! `grandis train --mode fb|flx|cob|mb|cluster|auto`: the job on partition-parallel ranks in this
//! process (`grandis-parallel`), with the machine's part of the run from the flags in
//! [`LocalArgs`] (a partition directory, emulated links, CUDA ordinals): per-epoch lines like
//! `--mode single`, the memory estimates, the sampling counters and the run summary.

use std::time::Duration;

use anyhow::bail;
use grandis_models::ModelConfig;
use grandis_parallel::LinkModel;
use grandis_parallel::{Compute, Machine, ParallelOptions, PartitionedGraph};
use grandis_store::Dataset;
use grandis_trainer::TrainOptions;
use grandis_wire::JobSpec;

/// Flags of an in-process parallel run that are not part of the job: where its partition,
/// links and devices come from.
#[derive(clap::Args, Debug, Clone, Default)]
pub struct LocalArgs {
    /// Emulated inter-server bandwidth per server NIC, bytes/s (default unlimited).
    #[arg(long)]
    pub inter_bandwidth: Option<f64>,
    /// Emulated intra-server bandwidth per device link, bytes/s (default unlimited).
    #[arg(long)]
    pub intra_bandwidth: Option<f64>,
    /// Emulated inter-server latency per message, milliseconds.
    #[arg(long, default_value_t = 0.0)]
    pub inter_latency_ms: f64,
    /// Emulated intra-server latency per message, milliseconds.
    #[arg(long, default_value_t = 0.0)]
    pub intra_latency_ms: f64,
    /// Threads sampling and building the plans of per-step modes (mb, cob, SAINT) ahead of
    /// the ranks, and reading their features (default: on CPU ranks half the cores, at most 8;
    /// on CUDA ranks every core but one per rank, at most 32). Any count gives the same run.
    #[arg(long, value_parser = clap::value_parser!(u16).range(1..))]
    pub plan_threads: Option<u16>,
}

/// The link `--{what}-bandwidth` and `--{what}-latency-ms` describe, checked.
pub(crate) fn link(
    bandwidth: Option<f64>,
    latency_ms: f64,
    what: &str,
) -> anyhow::Result<LinkModel> {
    if !(latency_ms.is_finite() && latency_ms >= 0.0) {
        bail!("--{what}-latency-ms must be a non-negative number, got {latency_ms}");
    }
    if let Some(b) = bandwidth {
        if !(b.is_finite() && b > 0.0) {
            bail!("--{what}-bandwidth must be a positive number of bytes/s, got {b}");
        }
    }
    Ok(LinkModel {
        bandwidth_bytes_per_s: bandwidth,
        latency: Duration::from_secs_f64(latency_ms / 1000.0),
    })
}

/// What the ranks of a run compute on.
#[derive(Debug, Clone, Default)]
pub struct Ranks {
    /// The total CPU thread budget (`--threads`), shared by the ranks.
    pub threads: Option<usize>,
    pub compute: Compute,
    /// `--device` as given, for the summary.
    pub device: String,
    /// `--checkpoint`, `--checkpoint-every`, `--resume`.
    pub checkpoint: grandis_trainer::CheckpointOptions,
}

/// Runs `spec` (a distributed mode) on `dataset` in this process and prints like `--mode
/// single`.
pub fn run(
    dataset: &Dataset,
    spec: &JobSpec,
    local: &LocalArgs,
    ranks: Ranks,
    json: bool,
) -> anyhow::Result<()> {
    let part = PartitionedGraph::for_job(dataset, spec)?;
    let view = dataset.view();
    let config = ModelConfig::for_job(spec, &view);
    let opts = TrainOptions::for_job(spec);
    let rank_count = (spec.servers * spec.devices) as usize;
    let popts = ParallelOptions {
        job: spec.clone(),
        machine: Machine {
            compute: ranks.compute.clone(),
            intra: link(local.intra_bandwidth, local.intra_latency_ms, "intra")?,
            inter: link(local.inter_bandwidth, local.inter_latency_ms, "inter")?,
            threads_per_rank: ranks.threads.map(|t| (t / rank_count).max(1)),
            checkpoint: ranks.checkpoint.clone(),
            plan_threads: local.plan_threads.map(usize::from),
            ..Machine::default()
        },
    };
    tracing::info!(
        "training {} ({} layers, hidden {}) with --mode {} on {} servers x {} devices ({}), \
         {} vertices, {} edges",
        spec.model,
        spec.layers,
        spec.hidden,
        spec.mode,
        spec.servers,
        spec.devices,
        part.source,
        view.num_vertices(),
        view.graph.num_edges()
    );
    let progress = std::sync::Mutex::new(grandis_telemetry::Progress::new(
        "train",
        Some(spec.epochs as u64),
    ));
    let report = grandis_parallel::train(view, &part, config, &opts, &popts, &mut |s| {
        if let Ok(mut p) = progress.lock() {
            p.println(crate::output::stats_line(s));
            p.inc(1);
        }
    })?;
    if let Ok(p) = progress.into_inner() {
        p.finish();
    }
    for (k, bytes) in &report.execution.preload_estimates {
        eprintln!("memory estimate k = {k}: {bytes} bytes on the worst device");
    }
    eprintln!(
        "preload hops k = {}: {}",
        report.execution.preload_hops, report.execution.preload_reason
    );
    eprintln!(
        "sampling {}: {} iteration(s)/epoch, {} sampled edges/epoch, computed vertices per \
         layer {:?}, beta per server {:?}",
        report.execution.sampling,
        report.execution.iterations_per_epoch,
        report.execution.sampled_edges,
        report.execution.computed_vertices_per_layer,
        report
            .execution
            .beta
            .iter()
            .map(|b| (b * 1000.0).round() / 1000.0)
            .collect::<Vec<_>>()
    );
    crate::output::print_summary(&report.summary(spec, ranks.device), json)
}
