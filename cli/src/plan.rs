//! `grandis plan`: what the performance model predicts for every candidate plan of a job
//! (`grandis_parallel::planner`): epoch time and its parts, bytes per link class, memory, and
//! which one it would run. Compute is calibrated on this machine; links come from the flags
//! or from what the cluster's servers measured (`--coordinator`).

use std::path::PathBuf;

use anyhow::Context;
use grandis_models::ModelConfig;
use grandis_parallel::planner::{candidates, choose, plan, Rates};
use grandis_parallel::{Compute, ParallelOptions, PartitionedGraph};
use grandis_wire::{LinkRate, Mode};

use crate::job_args::JobArgs;

#[derive(clap::Args)]
pub struct PlanArgs {
    /// Dataset directory.
    pub dataset: PathBuf,
    #[command(flatten)]
    pub job: JobArgs,
    /// Intra-server bandwidth per device link, bytes/s.
    #[arg(long, default_value_t = 10e9)]
    pub intra_bandwidth: f64,
    /// Inter-server bandwidth per server NIC, bytes/s.
    #[arg(long, default_value_t = 1.25e9)]
    pub inter_bandwidth: f64,
    /// Intra-server latency per message, milliseconds.
    #[arg(long, default_value_t = 0.01)]
    pub intra_latency_ms: f64,
    /// Inter-server latency per message, milliseconds.
    #[arg(long, default_value_t = 0.05)]
    pub inter_latency_ms: f64,
    /// Take the links from what the cluster's servers measured when their last job started
    /// (the slowest server's), from the coordinator at this URL.
    #[arg(long, requires = "token")]
    pub coordinator: Option<String>,
    /// API bearer token of --coordinator.
    #[arg(long, env = "GRANDIS_TOKEN", hide_env_values = true)]
    pub token: Option<String>,
    /// Where the ranks compute: cpu or cuda:N (calibrated here).
    #[arg(long, default_value = "cpu")]
    pub device: String,
    /// CPU threads per rank (default: this machine's cores / devices per server).
    #[arg(long)]
    pub threads_per_rank: Option<usize>,
    /// Every rank of every server runs on this machine (in-process `grandis train`, `cluster
    /// up`): they share its cores. Default: each server is a machine like this one.
    #[arg(long)]
    pub one_machine: bool,
    /// A sampled plan is chosen over the fastest exact one only when predicted this many
    /// times faster.
    #[arg(long, default_value_t = 1.2)]
    pub exact_preference: f64,
    /// Print the candidates as one JSON object on stdout.
    #[arg(long)]
    pub json: bool,
}

pub fn run(args: PlanArgs) -> anyhow::Result<()> {
    let dataset = grandis_store::Dataset::open(&args.dataset)
        .with_context(|| format!("opening dataset {}", args.dataset.display()))?;
    let view = dataset.view();
    // The mode only has to accept the sampler: every candidate is planned whatever it is.
    let sampled = args.job.sampling != "none";
    let spec = args.job.spec(
        args.dataset.display().to_string(),
        if sampled { Mode::Cob } else { Mode::Fb },
    )?;
    crate::job_args::validate_as_flags(&spec)?;
    let part = PartitionedGraph::for_job(&dataset, &spec)?;
    let config = ModelConfig::for_job(&spec, view.feature_dim, view.num_classes);
    let compute = Compute::parse(&args.device)?;
    let cores = std::thread::available_parallelism().map_or(1, |c| c.get());
    let devices = spec.devices as usize;
    let sharing = if args.one_machine {
        (spec.servers * spec.devices) as usize
    } else {
        devices
    };
    let threads = args
        .threads_per_rank
        .unwrap_or_else(|| (cores / sharing).max(1));
    let rate = match &compute {
        Compute::Cpu => grandis_parallel::measure::compute_rate(
            &grandis_engine::CpuBackend::new(Some(threads))?,
            spec.hidden as usize,
        )?,
        Compute::Cuda { .. } => anyhow::bail!(
            "calibrating a GPU is not wired into `grandis plan` yet: plan on the CPU, or read \
             the rates a cluster measured with --coordinator"
        ),
    };
    let (intra, inter) = match &args.coordinator {
        Some(url) => coordinator_links(url, args.token.as_deref().unwrap_or_default())?,
        None => (
            link(args.intra_bandwidth, args.intra_latency_ms, "intra")?,
            link(args.inter_bandwidth, args.inter_latency_ms, "inter")?,
        ),
    };
    let rates = Rates {
        compute: rate,
        intra,
        inter,
        contention: match compute {
            Compute::Cpu => ((sharing * threads) as f64 / cores as f64).max(1.0),
            Compute::Cuda { .. } => 1.0,
        },
        calibration: grandis_parallel::planner::calibrate(view, &config, &rate, threads)
            .context("calibrating on a sample of the graph")?,
        shared_cores: (args.one_machine && matches!(compute, Compute::Cpu)).then_some(cores),
    };
    let base = ParallelOptions {
        compute,
        threads_per_rank: Some(threads),
        ..ParallelOptions::for_job(&spec)
    };
    let cands = candidates(
        config.layers,
        spec.batch_size_or_default() as usize,
        devices,
        &spec.sampling,
    );
    let planned = plan(view, &part, &config, spec.seed, &base, &cands, &rates)?;
    let chosen = choose(&planned, args.exact_preference);
    if args.json {
        let value = serde_json::json!({
            "rates": rates,
            "candidates": planned,
            "chosen": chosen.as_ref().map(|(i, why)| serde_json::json!({
                "name": planned[*i].name, "why": why
            })),
        });
        println!("{value}");
        return Ok(());
    }
    println!(
        "rates: {:.2} GFLOP/s dense, {:.2} G edge-columns/s aggregation per rank (x{:.2} \
         contention, x{:.2} calibrated on a sample); intra {:.2} GB/s + {:.3} ms; inter {:.2} \
         GB/s + {:.3} ms",
        rates.compute.gemm_flops_per_s / 1e9,
        rates.compute.aggregation_edge_cols_per_s / 1e9,
        rates.contention,
        rates.calibration,
        rates.intra.bandwidth_bytes_per_s / 1e9,
        rates.intra.latency_s * 1e3,
        rates.inter.bandwidth_bytes_per_s / 1e9,
        rates.inter.latency_s * 1e3
    );
    println!(
        "{:<20} {:>9} {:>9} {:>9} {:>9} {:>9} {:>9} {:>9} {:>13} {:>13} {:>12} {:>5}",
        "candidate",
        "epoch_s",
        "compute",
        "intra",
        "inter",
        "fetch",
        "allred",
        "setup",
        "inter_B/ep",
        "intra_B/ep",
        "memory",
        "fits"
    );
    for p in &planned {
        match &p.prediction {
            Some(x) => println!(
                "{:<20} {:>9.3} {:>9.3} {:>9.3} {:>9.3} {:>9.3} {:>9.3} {:>9.3} {:>13} {:>13} \
                 {:>12} {:>5}",
                p.name,
                x.epoch_s,
                x.compute_s,
                x.intra_s,
                x.inter_s,
                x.fetch_s,
                x.all_reduce_s,
                x.setup_fetch_s,
                x.halo_bytes.inter_server + x.fetch_bytes.inter_server,
                x.halo_bytes.intra_server,
                x.peak_bytes,
                if p.fits { "yes" } else { "no" }
            ),
            None => println!(
                "{:<20} cannot run: {}",
                p.name,
                p.error.as_deref().unwrap_or("")
            ),
        }
    }
    match chosen {
        Some((i, why)) => println!("chosen: {} ({why})", planned[i].name),
        None => println!("chosen: none: no candidate fits the budget"),
    }
    Ok(())
}

/// The link the flags describe ([`crate::train_parallel::link`] checks them).
fn link(bandwidth: f64, latency_ms: f64, what: &str) -> anyhow::Result<LinkRate> {
    let model = crate::train_parallel::link(Some(bandwidth), latency_ms, what)?;
    Ok(LinkRate {
        bandwidth_bytes_per_s: bandwidth,
        latency_s: model.latency.as_secs_f64(),
    })
}

/// The slowest measured links over the coordinator's servers.
fn coordinator_links(url: &str, token: &str) -> anyhow::Result<(LinkRate, LinkRate)> {
    let view = crate::submit::client(url, token)
        .cluster()
        .with_context(|| format!("reading the cluster's rates from {url}"))?;
    let slowest = |pick: fn(&grandis_wire::ServerRates) -> Option<LinkRate>| {
        view.servers
            .iter()
            .filter_map(|s| s.rates.as_ref().and_then(pick))
            .min_by(|a, b| a.bandwidth_bytes_per_s.total_cmp(&b.bandwidth_bytes_per_s))
    };
    match (slowest(|r| r.intra), slowest(|r| r.inter)) {
        (Some(intra), Some(inter)) => Ok((intra, inter)),
        _ => anyhow::bail!(
            "the coordinator at {url} has no measured intra- and inter-server rates yet (they \
             are measured when a job starts on two or more servers of two or more devices)"
        ),
    }
}
