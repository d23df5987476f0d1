//! The `grandis train --mode fb|flx|cob|mb|auto` front end: the extra flags (flattened into
//! the CLI's `TrainArgs`), partitioning on the fly or from a partition directory, the
//! `--mode auto` decision (FLX when the full graph fits the budget, else CoB with the largest
//! co-batch that fits), per-epoch lines like `--mode single`, and the JSON summary
//! (single-mode keys plus traffic, k, memory and the sampling counters `sampled_edges`,
//! `computed_vertices_per_layer`, `beta`).

use std::path::PathBuf;
use std::time::Duration;

use anyhow::{bail, Context};
use grandis_fabric::LinkModel;
use grandis_models::ModelConfig;
use grandis_partition::{Method, PartitionBook};
use grandis_store::Dataset;
use grandis_trainer::TrainOptions;

use crate::{Compute, Mode, ParallelOptions, PartitionedGraph, Priority, Sampling};

/// Flags of the partition-parallel modes.
#[derive(clap::Args, Debug, Clone)]
pub struct ParallelArgs {
    /// fb/flx: number of (emulated) servers.
    #[arg(long, default_value_t = 1)]
    pub servers: usize,
    /// fb/flx: devices (worker threads) per server.
    #[arg(long, default_value_t = 1)]
    pub devices: usize,
    /// fb/flx: partition on the fly with metis, spring or random (ignored with --partition-dir).
    #[arg(long, default_value = "metis")]
    pub partition: String,
    /// fb/flx: seed of the on-the-fly partitioner.
    #[arg(long, default_value_t = 0)]
    pub partition_seed: u64,
    /// fb/flx: use a partition directory written by `grandis partition` for this dataset.
    #[arg(long)]
    pub partition_dir: Option<PathBuf>,
    /// flx: preloaded hops k (default: the largest k that fits --device-memory).
    #[arg(long)]
    pub preload_hops: Option<usize>,
    /// Per-device memory budget, bytes or with a unit ("64MiB", "16GiB"). flx: the largest k
    /// that fits; auto: FLX or CoB; every mode: a plan the memory model prices above it is
    /// out of memory (default: available memory / ranks, not enforced).
    #[arg(long, value_parser = grandis_wire::spec::parse_bytes)]
    pub device_memory: Option<u64>,
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
    /// flx/cob/mb: dependency sampling: none, eas (expansion-aware), fanout (GraphSAGE) or
    /// saint (GraphSAINT, cob only).
    #[arg(long, default_value = "none")]
    pub sampling: String,
    /// eas: external vertices at most this many hops from the server.
    #[arg(long, default_value_t = 1)]
    pub eas_hops: usize,
    /// eas: at most this many external in-neighbours per vertex.
    #[arg(long, default_value_t = 15)]
    pub eas_fanout: usize,
    /// eas: degree (the paper's priority) or uniform (the published artifact).
    #[arg(long, default_value = "degree")]
    pub eas_priority: String,
    /// fanout: per-hop fanouts from the targets, one per layer (e.g. 25,10,5).
    #[arg(long)]
    pub fanouts: Option<String>,
    /// saint: random-walk length (0 = the node sampler); the budget is --cobatch-size.
    #[arg(long, default_value_t = 2)]
    pub saint_walk_length: usize,
    /// flx with sampling: draw a new sample every N epochs (default: sample once).
    #[arg(long)]
    pub resample_every: Option<u64>,
    /// cob: target vertices per server per iteration (auto: the largest that fits).
    #[arg(long)]
    pub cobatch_size: Option<usize>,
    /// mb: target vertices per device per iteration.
    #[arg(long)]
    pub batch_size: Option<usize>,
    /// With --device cuda: the CUDA ordinals of a server's ranks, device index d on the d-th
    /// (cycled), e.g. 0,1,2,3. Default: device index d on ordinal d.
    #[arg(long, value_delimiter = ',')]
    pub cuda_devices: Option<Vec<usize>>,
}

fn link(bandwidth: Option<f64>, latency_ms: f64, what: &str) -> anyhow::Result<LinkModel> {
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

impl ParallelArgs {
    /// The sampler the flags ask for.
    pub fn sampling(&self) -> anyhow::Result<Sampling> {
        self.sampling_of(&self.sampling)
    }

    /// Sampler `name` (none, eas, fanout, saint) with the parameters of the flags.
    pub fn sampling_of(&self, name: &str) -> anyhow::Result<Sampling> {
        Ok(match name {
            "none" => Sampling::None,
            "eas" => Sampling::Eas {
                hops: self.eas_hops,
                fanout: self.eas_fanout,
                priority: self
                    .eas_priority
                    .parse::<Priority>()
                    .map_err(|e| anyhow::anyhow!("--eas-priority: {e}"))?,
            },
            "fanout" => {
                let f = self
                    .fanouts
                    .as_deref()
                    .context("--sampling fanout needs --fanouts F1,F2,... (one per layer)")?;
                let parsed = grandis_sampling::Fanout::parse(f, 0)
                    .map_err(|e| anyhow::anyhow!("--fanouts {f}: {e}"))?;
                Sampling::Fanout {
                    fanouts: parsed.fanouts,
                }
            }
            "saint" => Sampling::Saint {
                walk_length: (self.saint_walk_length > 0).then_some(self.saint_walk_length),
            },
            other => bail!("unknown --sampling '{other}' (expected none, eas, fanout or saint)"),
        })
    }

    /// Where the ranks compute: `device` is `--device` (cpu, cuda or cuda:N), refined by
    /// `--cuda-devices`.
    pub fn compute(&self, device: &str) -> anyhow::Result<Compute> {
        let compute = Compute::parse(device)?;
        match (&compute, &self.cuda_devices) {
            (_, None) => Ok(compute),
            (Compute::Cuda { ordinals: None }, Some(list)) if !list.is_empty() => {
                Ok(Compute::Cuda {
                    ordinals: Some(list.clone()),
                })
            }
            (_, Some(_)) => bail!(
                "--cuda-devices needs --device cuda (not --device {device}) and at least one \
                 ordinal"
            ),
        }
    }

    /// The fabric/preloading options for `mode`; `threads` is the total thread budget.
    pub fn options(&self, mode: Mode, threads: Option<usize>) -> anyhow::Result<ParallelOptions> {
        let ranks = self.servers.max(1) * self.devices.max(1);
        let mut sampling = self.sampling()?;
        // MB is the per-GPU GraphSAGE baseline: --fanouts alone means fanout sampling.
        if mode == Mode::Mb && sampling.is_none() {
            if let Some(f) = &self.fanouts {
                sampling = Sampling::Fanout {
                    fanouts: grandis_sampling::Fanout::parse(f, 0)
                        .map_err(|e| anyhow::anyhow!("--fanouts {f}: {e}"))?
                        .fanouts,
                };
            }
        }
        let batch_size = match mode {
            Mode::Cob => self.cobatch_size,
            Mode::Mb => self.batch_size,
            _ => None,
        };
        Ok(ParallelOptions {
            mode,
            preload_hops: self.preload_hops,
            device_memory: self.device_memory,
            intra: link(self.intra_bandwidth, self.intra_latency_ms, "intra")?,
            inter: link(self.inter_bandwidth, self.inter_latency_ms, "inter")?,
            threads_per_rank: threads.map(|t| (t / ranks).max(1)),
            sampling,
            batch_size,
            resample_every: self.resample_every,
            ..Default::default()
        })
    }

    /// The partitioned graph: from `--partition-dir` (checked against the dataset and the
    /// requested shape) or partitioned now.
    pub fn partitioned(&self, dataset: &Dataset) -> anyhow::Result<PartitionedGraph> {
        if self.servers == 0 || self.devices == 0 {
            bail!(
                "--servers ({}) and --devices ({}) must both be at least 1",
                self.servers,
                self.devices
            );
        }
        let n = dataset.manifest().num_vertices;
        let ranks = (self.servers * self.devices) as u64;
        if ranks > n {
            bail!(
                "--servers {} x --devices {} = {ranks} ranks is more than the {n} vertices of {}",
                self.servers,
                self.devices,
                dataset.dir().display()
            );
        }
        if let Some(dir) = &self.partition_dir {
            let book = PartitionBook::open(dir)
                .with_context(|| format!("opening partition dir {}", dir.display()))?;
            if book.num_servers() as usize != self.servers
                || book.num_devices() as usize != self.devices
            {
                bail!(
                    "partition dir {} is for {} servers x {} devices, the run asks for \
                     --servers {} --devices {}",
                    dir.display(),
                    book.num_servers(),
                    book.num_devices(),
                    self.servers,
                    self.devices
                );
            }
            return PartitionedGraph::from_book(&book, dataset);
        }
        let method: Method = self
            .partition
            .parse()
            .with_context(|| format!("--partition {}", self.partition))?;
        PartitionedGraph::partition(
            &dataset.view(),
            dataset.manifest().symmetric,
            self.servers,
            self.devices,
            method,
            self.partition_seed,
        )
    }
}

/// `--mode auto` (GraNNDIS §8.6): FLX with the largest k that fits when plain FB fits the
/// per-device budget (the full graph fits the servers' aggregate memory), otherwise CoB with
/// the largest co-batch that fits (with the sampler the run will use). Prints the decision,
/// the budget and the estimate, and returns the options to train with.
pub fn decide_auto(
    view: &grandis_store::DatasetView<'_>,
    part: &PartitionedGraph,
    config: &ModelConfig,
    popts: &ParallelOptions,
    seed: u64,
) -> anyhow::Result<(ParallelOptions, grandis_sampling::AutoDecision)> {
    let ctx = crate::plan_context(view, part)?;
    let dims = crate::model_dims(config);
    let (budget, _) = crate::budget::budget(popts, &part.layout)?;
    let sampler = popts
        .sampling
        .sampler(seed)?
        .unwrap_or_else(|| Box::new(grandis_sampling::Exact));
    let decision = grandis_sampling::auto_mode(&ctx, &dims, budget, sampler.as_ref(), seed)
        .context("--mode auto")?;
    eprintln!("{decision}");
    let popts = match decision.mode {
        grandis_sampling::Mode::Flx { k } => ParallelOptions {
            mode: if k == 0 { Mode::Fb } else { Mode::Flx },
            preload_hops: (k > 0).then_some(k),
            // FLX trains on the exact graph or with EAS; other samplers are co-batch ones.
            sampling: match popts.sampling {
                Sampling::Eas { .. } if k > 0 => popts.sampling.clone(),
                _ => Sampling::None,
            },
            ..popts.clone()
        },
        grandis_sampling::Mode::Cob { batch_size } => ParallelOptions {
            mode: Mode::Cob,
            preload_hops: None,
            batch_size: Some(batch_size),
            ..popts.clone()
        },
    };
    Ok((popts, decision))
}

/// What the ranks of a run compute on: the total CPU thread budget (`--threads`) and the
/// device (`--device`, `--cuda-devices`).
#[derive(Debug, Clone, Default)]
pub struct RankResources {
    pub threads: Option<usize>,
    pub compute: Compute,
}

/// Runs `grandis train DATASET --mode fb|flx|cob|mb|auto ...` (`mode` None = auto) and prints
/// like `--mode single`.
pub fn run(
    dataset: &Dataset,
    mode: Option<Mode>,
    args: &ParallelArgs,
    config: ModelConfig,
    opts: TrainOptions,
    ranks: RankResources,
    json: bool,
) -> anyhow::Result<()> {
    let RankResources { threads, compute } = ranks;
    let part = args.partitioned(dataset)?;
    let view = dataset.view();
    let with_compute = |popts: ParallelOptions| ParallelOptions {
        compute: compute.clone(),
        ..popts
    };
    let (popts, auto) = match mode {
        Some(m) => (with_compute(args.options(m, threads)?), None),
        None => {
            let base = with_compute(args.options(Mode::Cob, threads)?);
            let (p, d) = decide_auto(&view, &part, &config, &base, opts.seed)?;
            (p, Some(d))
        }
    };
    let mode = popts.mode;
    tracing::info!(
        "training {} ({} layers, hidden {}) with --mode {} on {} servers x {} devices ({}), \
         {} vertices, {} edges",
        config.kind.name(),
        config.layers,
        config.hidden,
        mode.name(),
        args.servers,
        args.devices,
        part.source,
        view.num_vertices(),
        view.graph.num_edges()
    );
    let progress = std::sync::Mutex::new(grandis_telemetry::Progress::new(
        "train",
        Some(opts.epochs as u64),
    ));
    let report = crate::train(view, &part, config.clone(), &opts, &popts, &mut |s| {
        if let Ok(mut p) = progress.lock() {
            p.println(format!(
                "epoch {:>4}  loss {:.4}  train {:.4}  val {:.4}  {:.3}s",
                s.epoch, s.loss, s.train_acc, s.val_acc, s.seconds
            ));
            p.inc(1);
        }
    })?;
    if let Ok(p) = progress.into_inner() {
        p.finish();
    }
    for (k, bytes) in &report.k_estimates {
        eprintln!("memory estimate k = {k}: {bytes} bytes on the worst device");
    }
    eprintln!(
        "preload hops k = {}: {}",
        report.preload_hops, report.k_reason
    );
    let t = &report.time;
    let tr = &report.train;
    eprintln!(
        "sampling {}: {} iteration(s)/epoch, {} sampled edges/epoch, computed vertices per \
         layer {:?}, beta per server {:?}",
        report.sampling,
        report.iterations_per_epoch,
        report.sampled_edges,
        report.computed_vertices_per_layer,
        report
            .beta
            .iter()
            .map(|b| (b * 1000.0).round() / 1000.0)
            .collect::<Vec<_>>()
    );
    let summary = format!(
        "final loss {:.4}  train {:.4}  val {:.4}  test {:.4}  median epoch {:.3}s  \
         (compute {:.3}s, intra {:.3}s, inter {:.3}s, fetch {:.3}s, all-reduce {:.3}s)  halo \
         bytes/epoch inter {} intra {}  fetched bytes inter/epoch {} (setup {})",
        tr.final_loss,
        tr.train_acc,
        tr.val_acc,
        tr.test_acc,
        tr.median_epoch_s,
        t.compute_s,
        t.intra_comm_s,
        t.inter_comm_s,
        t.fetch_s,
        t.all_reduce_s,
        report.halo_bytes_per_epoch.inter_server,
        report.halo_bytes_per_epoch.intra_server,
        report.fetch_bytes_per_epoch.inter_server,
        report.setup_fetch_bytes.inter_server
    );
    if json {
        eprintln!("{summary}");
        let json = serde_json::json!({
            "mode": mode.name(),
            "device": popts.compute,
            "model": config,
            "train": opts,
            "num_parameters": tr.num_parameters,
            "first_epoch": tr.first_epoch,
            "test_acc": tr.test_acc,
            "val_acc": tr.val_acc,
            "train_acc": tr.train_acc,
            "final_loss": tr.final_loss,
            "median_epoch_s": tr.median_epoch_s,
            "peak_rss_bytes": grandis_telemetry::peak_rss_bytes(),
            "losses": tr.epochs.iter().map(|s| s.loss).collect::<Vec<_>>(),
            "epoch_seconds": tr.epochs.iter().map(|s| s.seconds).collect::<Vec<_>>(),
            "servers": report.servers,
            "devices": report.devices,
            "partition": report.partition,
            "threads_per_rank": report.threads_per_rank,
            "preload_hops": report.preload_hops,
            "preload_reason": report.k_reason,
            "preload_estimates": report.k_estimates,
            "replicated_vertices": report.replicated_vertices,
            "bytes_inter_server": report.halo_bytes_per_epoch.inter_server,
            "bytes_intra_server": report.halo_bytes_per_epoch.intra_server,
            "predicted_bytes_inter_server": report.predicted_halo_bytes_per_epoch.inter_server,
            "predicted_bytes_intra_server": report.predicted_halo_bytes_per_epoch.intra_server,
            "forward_bytes": report.forward_bytes_per_epoch,
            "backward_bytes": report.backward_bytes_per_epoch,
            "all_reduce_bytes_inter_server": report.all_reduce_bytes_per_epoch.inter_server,
            "all_reduce_bytes_intra_server": report.all_reduce_bytes_per_epoch.intra_server,
            "fetch_bytes_per_epoch": report.fetch_bytes_per_epoch,
            "setup_fetch_bytes": report.setup_fetch_bytes,
            "time_split": report.time,
            "memory": report.memory,
        });
        // A second object: one json! invocation of every key exceeds the macro recursion
        // limit.
        let extra = serde_json::json!({
            "sampling": report.sampling,
            "sampling_options": popts.sampling,
            "batch_size": report.batch_size,
            "iterations_per_epoch": report.iterations_per_epoch,
            "targets_per_epoch": report.targets_per_epoch,
            "resample_every": popts.resample_every,
            "sampled_edges": report.sampled_edges,
            "computed_vertices_per_layer": report.computed_vertices_per_layer,
            "computed_vertex_layers": report.computed_vertex_layers,
            "aggregated_edges_per_layer": report.aggregated_edges_per_layer,
            "beta": report.beta,
            "auto": auto,
        });
        let mut json = json;
        if let (Some(a), serde_json::Value::Object(b)) = (json.as_object_mut(), extra) {
            a.extend(b);
        }
        println!("{json}");
    } else {
        println!("{summary}");
    }
    Ok(())
}
