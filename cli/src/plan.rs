//! `grandis plan`: what `mode = auto` would run for a job, and why: every candidate plan
//! (`grandis_parallel::auto::plan_job`) with its predicted epoch time and its parts, bytes
//! per link class, memory, and the choice. Compute is measured and calibrated here; links
//! come from the flags, or compute and links from what the cluster's servers measured when
//! their last job started (`--coordinator`).

use std::path::PathBuf;

use anyhow::Context;
use grandis_models::ModelConfig;
use grandis_parallel::auto::{plan_job, plan_rates, Placement};
use grandis_parallel::{Compute, Machine, ParallelOptions, PartitionedGraph};
use grandis_wire::{LinkRate, Mode, ServerRates};

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
    /// Take compute and links from what the cluster's servers measured when their last job
    /// started (the slowest server's), from the coordinator at this URL.
    #[arg(long, requires = "token")]
    pub coordinator: Option<String>,
    /// API bearer token of --coordinator.
    #[arg(long, env = "GRANDIS_TOKEN", hide_env_values = true)]
    pub token: Option<String>,
    /// Where the ranks compute: cpu (measured and calibrated here), or cuda with
    /// --coordinator (the servers' measured GPUs).
    #[arg(long, default_value = "cpu")]
    pub device: Compute,
    /// CPU threads per rank (default: this machine's cores / devices per server).
    #[arg(long)]
    pub threads_per_rank: Option<usize>,
    /// Every rank of every server runs on this machine (in-process `grandis train`, `cluster
    /// up`): they share its cores. Default: each server is a machine like this one.
    #[arg(long)]
    pub one_machine: bool,
    /// Count every candidate; by default a static plan (fb, flx) is counted only when what
    /// its own rows cost leaves it able to be chosen, as `mode auto` does.
    #[arg(long)]
    pub all: bool,
    /// Print the candidates as one JSON object on stdout.
    #[arg(long)]
    pub json: bool,
}

pub fn run(args: PlanArgs) -> anyhow::Result<()> {
    let dataset = grandis_store::Dataset::open(&args.dataset)
        .with_context(|| format!("opening dataset {}", args.dataset.display()))?;
    let view = dataset.view();
    let mut spec = args
        .job
        .spec(args.dataset.display().to_string(), Mode::Auto)?;
    spec.mode = Mode::Auto;
    let (servers, devices) = (spec.servers as usize, spec.devices as usize);
    let measured = match &args.coordinator {
        Some(url) => coordinator_rates(url, args.token.as_deref().unwrap_or_default())?,
        None => Vec::new(),
    };
    let compute = match measured.first() {
        Some(s) => Compute::parse(&s.device)?,
        None => args.device.clone(),
    };
    if compute.is_cuda() && measured.is_empty() {
        anyhow::bail!(
            "--device {}: a GPU's rates come from the servers that measured it: pass \
             --coordinator (or plan on the CPU)",
            args.device
        );
    }
    let sharing = if args.one_machine {
        servers * devices
    } else {
        devices
    };
    if spec.device_memory.is_none() {
        // What each rank would get: this machine's memory over the ranks sharing it.
        let machines = if args.one_machine { servers } else { 1 };
        spec.device_memory = Some(grandis_parallel::default_budget(&compute, machines, devices)?.0);
    }
    crate::job_args::validate_as_flags(&spec)?;
    let part = PartitionedGraph::for_job(&dataset, &spec)?;
    let config = ModelConfig::for_job(&spec, &view);
    let threads = args
        .threads_per_rank
        .unwrap_or_else(|| grandis_parallel::cores_per_rank(sharing));
    let measured = match measured.is_empty() {
        false => measured,
        true => vec![ServerRates {
            device: compute.name(),
            compute: grandis_parallel::measure::compute_rate(
                &grandis_engine::CpuBackend::new(Some(threads))?,
                spec.hidden as usize,
            )?,
            intra: Some(link(args.intra_bandwidth, args.intra_latency_ms, "intra")?),
            inter: Some(link(args.inter_bandwidth, args.inter_latency_ms, "inter")?),
            seconds: 0.0,
            memory_copy_bytes_per_s: 0.0,
        }],
    };
    let placement = Placement {
        compute: compute.clone(),
        threads_per_rank: threads,
        ranks_per_machine: sharing,
        one_machine: args.one_machine,
    };
    let rates = plan_rates(view, &config, &measured, &placement)?;
    let popts = ParallelOptions {
        job: spec.clone(),
        machine: Machine {
            compute,
            threads_per_rank: Some(threads),
            ..Machine::default()
        },
    };
    let job = plan_job(view, &part, &config, &popts, spec.seed, rates, !args.all)?;
    let (planned, rates) = (&job.planned, &job.rates);
    let chosen = job.chosen.clone();
    if args.json {
        let value = serde_json::json!({
            "rates": rates,
            "candidates": planned,
            "budget": job.budget,
            "exact_preference": job.exact_preference,
            "seconds": job.seconds,
            "chosen": chosen.as_ref().map(|(i, why)| serde_json::json!({
                "name": planned[*i].name, "why": why
            })),
        });
        println!("{value}");
        return Ok(());
    }
    println!(
        "rates: {:.2} GFLOP/s dense, {:.2} G edge-columns/s aggregation per rank (x{:.2} \
         contention, x{:.2} calibrated on a sample: dense x{:.2}, aggregation x{:.2}); intra \
         {:.2} GB/s + {:.3} ms; inter {:.2} GB/s + {:.3} ms",
        rates.compute.gemm_flops_per_s / 1e9,
        rates.compute.aggregation_edge_cols_per_s / 1e9,
        rates.contention,
        rates.calibration,
        rates.kernel_factors().dense,
        rates.kernel_factors().aggregation,
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
    for p in planned {
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
            None => match (&p.pruned, &p.error) {
                (Some(why), _) => println!("{:<20} not counted: {why}", p.name),
                (_, e) => println!("{:<20} cannot run: {}", p.name, e.as_deref().unwrap_or("")),
            },
        }
    }
    match chosen {
        Some((i, why)) => println!("chosen: {} ({why})", planned[i].name),
        None => println!(
            "chosen: none: no candidate fits the {}-byte budget",
            job.budget
        ),
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

/// What the coordinator's servers measured when their last job started.
fn coordinator_rates(url: &str, token: &str) -> anyhow::Result<Vec<ServerRates>> {
    let view = crate::submit::client(url, token)
        .cluster()
        .with_context(|| format!("reading the cluster's rates from {url}"))?;
    let rates: Vec<ServerRates> = view.servers.into_iter().filter_map(|s| s.rates).collect();
    if rates.is_empty() {
        anyhow::bail!(
            "the coordinator at {url} has no measured rates yet (servers measure themselves \
             when a job starts on them)"
        );
    }
    Ok(rates)
}
