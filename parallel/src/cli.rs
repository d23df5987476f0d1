//! The `grandis train --mode fb|flx` front end: the extra flags (flattened into the CLI's
//! `TrainArgs`), partitioning on the fly or from a partition directory, per-epoch lines like
//! `--mode single`, and the JSON summary (single-mode keys plus traffic, k and memory).

use std::path::PathBuf;
use std::time::Duration;

use anyhow::{bail, Context};
use grandis_fabric::LinkModel;
use grandis_models::ModelConfig;
use grandis_partition::{Method, PartitionBook};
use grandis_store::Dataset;
use grandis_trainer::TrainOptions;

use crate::{Mode, ParallelOptions, PartitionedGraph};

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
    /// flx: per-device memory budget in bytes (default: available memory / ranks).
    #[arg(long)]
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
    /// The fabric/preloading options for `mode`; `threads` is the total thread budget.
    pub fn options(&self, mode: Mode, threads: Option<usize>) -> anyhow::Result<ParallelOptions> {
        let ranks = self.servers.max(1) * self.devices.max(1);
        Ok(ParallelOptions {
            mode,
            preload_hops: self.preload_hops,
            device_memory: self.device_memory,
            intra: link(self.intra_bandwidth, self.intra_latency_ms, "intra")?,
            inter: link(self.inter_bandwidth, self.inter_latency_ms, "inter")?,
            threads_per_rank: threads.map(|t| (t / ranks).max(1)),
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

/// Runs `grandis train DATASET --mode fb|flx ...` and prints like `--mode single`.
pub fn run(
    dataset: &Dataset,
    mode: Mode,
    args: &ParallelArgs,
    config: ModelConfig,
    opts: TrainOptions,
    threads: Option<usize>,
    json: bool,
) -> anyhow::Result<()> {
    let popts = args.options(mode, threads)?;
    let part = args.partitioned(dataset)?;
    let view = dataset.view();
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
    let summary = format!(
        "final loss {:.4}  train {:.4}  val {:.4}  test {:.4}  median epoch {:.3}s  \
         (compute {:.3}s, intra {:.3}s, inter {:.3}s, all-reduce {:.3}s)  halo bytes/epoch \
         inter {} intra {}",
        tr.final_loss,
        tr.train_acc,
        tr.val_acc,
        tr.test_acc,
        tr.median_epoch_s,
        t.compute_s,
        t.intra_comm_s,
        t.inter_comm_s,
        t.all_reduce_s,
        report.halo_bytes_per_epoch.inter_server,
        report.halo_bytes_per_epoch.intra_server
    );
    if json {
        eprintln!("{summary}");
        let json = serde_json::json!({
            "mode": mode.name(),
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
            "time_split": report.time,
            "memory": report.memory,
        });
        println!("{json}");
    } else {
        println!("{summary}");
    }
    Ok(())
}
