//! Partition-parallel full-batch training of grandis (GraNNDIS §4, §5.1, §6): S servers × G
//! devices run as worker threads over the in-process fabric (`grandis-fabric`), each on its own
//! CPU backend, training the models of `grandis-models` over the per-device plans of
//! `grandis-masking`. `Mode::Fb` is FB_base (PipeGCN without the pipeline): every rank owns its
//! partition range plus a one-hop halo and, at every layer, exchanges halo features forward and
//! halo gradients backward with every peer it shares edges with, intra- and inter-server.
//! `Mode::Flx` is flexible preloading with one-hop graph masking: each server replicates the
//! k-hop in-neighbourhood of its vertices, layers `< k` run on that (masked) FLX plan with
//! intra-server exchanges only, layers `>= k` on the FB plan (the reshape); k is the largest
//! that fits the per-device memory budget unless given. Weight gradients are summed with the
//! fabric's hierarchical, bit-identical all-reduce, so all ranks keep identical weights. Every
//! normalisation uses GLOBAL degrees and every dropout mask is keyed by the dataset's ORIGINAL
//! vertex id, so for any partition and any k the per-epoch losses and final logits equal the
//! single-process trainer's (`grandis-trainer`) up to float summation order. Each rank's backend
//! is wrapped in [`metered::Metered`], which counts its live buffer bytes so the masking crate's
//! memory model can be checked against what a rank really holds.

pub mod cli;
pub mod input;
pub mod metered;
pub mod server;
mod worker;

use std::sync::Mutex;

use anyhow::{bail, Context};
use grandis_engine::norm::global_scales;
use grandis_engine::CpuBackend;
use grandis_fabric::{Counters, Fabric, FabricConfig, LinkClass, Phase};
use grandis_masking::{
    KChoice, KEstimate, ModelDims, PlanContext, PreloadPlan, SplitMembership, SPLIT_TEST,
    SPLIT_TRAIN, SPLIT_VAL,
};
use grandis_models::{ModelConfig, ModelKind};
use grandis_store::DatasetView;
use grandis_trainer::{EpochStats, TrainOptions, TrainReport};
use serde::Serialize;

pub use grandis_fabric::LinkModel;
pub use input::PartitionedGraph;
pub use worker::EVAL_EPOCH_BIT;

/// Which partition-parallel scheme.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum Mode {
    /// FB_base: one-hop halo exchange at every layer with every peer.
    Fb,
    /// Flexible preloading (k hops) with one-hop graph masking.
    Flx,
}

impl Mode {
    pub fn parse(s: &str) -> Option<Mode> {
        match s {
            "fb" => Some(Mode::Fb),
            "flx" => Some(Mode::Flx),
            _ => None,
        }
    }
    pub fn name(self) -> &'static str {
        match self {
            Mode::Fb => "fb",
            Mode::Flx => "flx",
        }
    }
}

/// Options of a parallel run beyond the model and optimiser.
#[derive(Debug, Clone)]
pub struct ParallelOptions {
    pub mode: Mode,
    /// FLX: force k instead of choosing it from the memory budget.
    pub preload_hops: Option<usize>,
    /// FLX: per-device memory budget in bytes; None = [`default_device_memory`].
    pub device_memory: Option<u64>,
    pub intra: LinkModel,
    pub inter: LinkModel,
    /// Rayon threads of each rank's CPU backend; None = cores / ranks, at least 1.
    pub threads_per_rank: Option<usize>,
    /// Evaluate (dropout off) after every epoch, as `--mode single` does; benchmarks skip it.
    pub eval_every_epoch: bool,
    /// Return the final logits of every vertex (tests).
    pub collect_logits: bool,
}

impl Default for ParallelOptions {
    fn default() -> Self {
        ParallelOptions {
            mode: Mode::Fb,
            preload_hops: None,
            device_memory: None,
            intra: LinkModel::unlimited(),
            inter: LinkModel::unlimited(),
            threads_per_rank: None,
            eval_every_epoch: true,
            collect_logits: false,
        }
    }
}

/// Bytes of one epoch by link class (payload bytes put on the wire, summed over ranks).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize)]
pub struct ClassBytes {
    pub intra_server: u64,
    pub inter_server: u64,
}

/// Mean seconds per training epoch, averaged over ranks and over epochs (the first, warm-up
/// epoch left out when there are several).
#[derive(Debug, Clone, Copy, Default, PartialEq, Serialize)]
pub struct TimeSplit {
    /// Wall time of the training step.
    pub epoch_s: f64,
    /// Outside any fabric call: the backend's work and packing of halo buffers.
    pub compute_s: f64,
    /// Halo exchange calls minus the time blocked on inter-server peers.
    pub intra_comm_s: f64,
    /// Time blocked receiving halo rows/gradients from other servers (emulated link time).
    pub inter_comm_s: f64,
    /// Weight-gradient all-reduce calls.
    pub all_reduce_s: f64,
    /// Loss all-reduce and other small collectives.
    pub other_s: f64,
}

/// Measured memory of one rank next to the memory model's estimate.
#[derive(Debug, Clone, Serialize)]
pub struct RankMemory {
    pub rank: usize,
    /// Peak live bytes of backend buffers, indices and graphs (the metered backend).
    pub measured_peak_bytes: u64,
    /// Live bytes after setup, before the first epoch.
    pub setup_bytes: u64,
    /// `grandis_masking::memory` estimate for this rank.
    pub model_bytes: u64,
}

/// Everything a parallel run reports.
#[derive(Debug, Clone, Serialize)]
pub struct ParallelReport {
    pub mode: Mode,
    pub servers: usize,
    pub devices: usize,
    pub partition: String,
    pub threads_per_rank: usize,
    pub preload_hops: usize,
    /// Why this k (budget and estimates), or "fixed by --preload-hops" / "FB mode".
    pub k_reason: String,
    /// `(k, worst-device bytes)` of the estimates computed for the choice.
    pub k_estimates: Vec<(usize, u64)>,
    /// Vertices replicated by FLX preloading over all servers.
    pub replicated_vertices: usize,
    /// Feature and gradient halo traffic per epoch (forward + backward phases).
    pub halo_bytes_per_epoch: ClassBytes,
    pub forward_bytes_per_epoch: ClassBytes,
    pub backward_bytes_per_epoch: ClassBytes,
    /// The masking plan's prediction of `halo_bytes_per_epoch`.
    pub predicted_halo_bytes_per_epoch: ClassBytes,
    /// Weight-gradient all-reduce traffic per epoch.
    pub all_reduce_bytes_per_epoch: ClassBytes,
    pub time: TimeSplit,
    pub memory: Vec<RankMemory>,
    #[serde(skip)]
    pub train: TrainReport,
    /// Final logits (dropout off) in ORIGINAL vertex order, `n x classes`, when requested.
    #[serde(skip)]
    pub logits: Option<Vec<f32>>,
    /// Fabric counters summed over ranks (training and evaluation epochs).
    #[serde(skip)]
    pub counters: Counters,
}

/// Available system memory divided by the `ranks` that share this machine: the default
/// per-device budget of CPU workers (all S × G ranks run in this process, so the "server's"
/// memory is the machine's). `MemAvailable` from `/proc/meminfo`.
pub fn default_device_memory(ranks: usize) -> anyhow::Result<u64> {
    let info = std::fs::read_to_string("/proc/meminfo")
        .context("reading /proc/meminfo for the default --device-memory")?;
    let kib: u64 = info
        .lines()
        .find_map(|l| l.strip_prefix("MemAvailable:"))
        .and_then(|v| v.trim().trim_end_matches("kB").trim().parse().ok())
        .context("/proc/meminfo has no MemAvailable line; pass --device-memory BYTES")?;
    Ok(kib * 1024 / ranks.max(1) as u64)
}

/// The shape the memory model prices. ResSAGE+ exchanges hidden-width rows at every layer
/// (the encoder runs before layer 0), so its layer-0 width is the hidden width.
pub fn model_dims(config: &ModelConfig) -> ModelDims {
    let res = config.kind == ModelKind::ResSage;
    ModelDims {
        layers: config.layers,
        features: if res { config.hidden } else { config.in_dim },
        hidden: config.hidden,
        classes: if res { config.hidden } else { config.classes },
    }
}

/// The k a run will use, with its reason and estimates.
pub fn choose_preload_hops(
    ctx: &PlanContext<'_>,
    config: &ModelConfig,
    popts: &ParallelOptions,
) -> anyhow::Result<KChoice> {
    let dims = model_dims(config);
    match (popts.mode, popts.preload_hops) {
        (Mode::Fb, Some(k)) if k > 0 => {
            bail!("--preload-hops {k} needs --mode flx (FB_base never preloads)")
        }
        (Mode::Fb, _) => Ok(KChoice {
            k: 0,
            estimates: vec![grandis_masking::estimate(&dims, &ctx.fb_plan()?, None)],
            reason: "FB_base: no preloading (k = 0)".into(),
        }),
        (Mode::Flx, Some(k)) => {
            if k > config.layers {
                bail!(
                    "--preload-hops {k} is more than the model's {} layers",
                    config.layers
                );
            }
            Ok(KChoice {
                k,
                estimates: Vec::new(),
                reason: format!("k = {k} fixed by --preload-hops"),
            })
        }
        (Mode::Flx, None) => {
            let ranks = ctx.layout().num_ranks();
            let (budget, from) = match popts.device_memory {
                Some(b) => (b, "--device-memory".to_string()),
                None => (
                    default_device_memory(ranks)?,
                    format!("available system memory / {ranks} ranks on this machine"),
                ),
            };
            let choice = ctx.choose_k(&dims, budget).with_context(|| {
                format!("choosing k for a per-device budget of {budget} bytes ({from})")
            })?;
            Ok(KChoice {
                reason: format!("{} (budget from {from})", choice.reason),
                ..choice
            })
        }
    }
}

/// Trains `config` on `view` (the dataset in its ORIGINAL ids) partitioned as `part`,
/// calling `on_epoch` after every epoch with the same numbers `--mode single` reports.
pub fn train(
    view: DatasetView<'_>,
    part: &PartitionedGraph,
    config: ModelConfig,
    opts: &TrainOptions,
    popts: &ParallelOptions,
    on_epoch: &mut (dyn FnMut(&EpochStats) + Send),
) -> anyhow::Result<ParallelReport> {
    train_ranks(view, part, config, opts, popts, on_epoch, None)
}

/// [`train`], or — with `local` — only the ranks of one server over the given endpoints
/// ([`server::train_server`]): the setup, the plans and the worker are the same either way.
pub(crate) fn train_ranks(
    view: DatasetView<'_>,
    part: &PartitionedGraph,
    config: ModelConfig,
    opts: &TrainOptions,
    popts: &ParallelOptions,
    on_epoch: &mut (dyn FnMut(&EpochStats) + Send),
    local: Option<Vec<grandis_fabric::Endpoint>>,
) -> anyhow::Result<ParallelReport> {
    let n = view.num_vertices();
    if config.in_dim != view.feature_dim || config.classes != view.num_classes {
        bail!(
            "model expects {} features and {} classes, dataset has {} and {}",
            config.in_dim,
            config.classes,
            view.feature_dim,
            view.num_classes
        );
    }
    config
        .validate()
        .map_err(|e| anyhow::anyhow!("invalid model configuration: {e}"))?;
    if config.kind == ModelKind::Mlp {
        bail!("--model mlp reads no graph; partition-parallel modes need sage, gcn or ressage");
    }
    if view.features.len() != n * view.feature_dim || view.labels.len() != n {
        bail!(
            "dataset holds {} feature values and {} labels for {n} vertices x {} features",
            view.features.len(),
            view.labels.len(),
            view.feature_dim
        );
    }
    if part.graph.view().num_vertices() != n || part.new_to_old.len() != n {
        bail!(
            "the partitioned graph has {} vertices, the dataset {n}",
            part.graph.view().num_vertices()
        );
    }
    let layout = part.layout.clone();
    let (servers, devices) = (layout.servers(), layout.devices());
    let ranks = layout.num_ranks();
    if ranks > n {
        bail!(
            "{servers} servers x {devices} devices = {ranks} ranks is more than the {n} vertices"
        );
    }
    if let Some(r) = layout.ranges().iter().position(|r| r.is_empty()) {
        bail!(
            "rank {r} (server {}, device {}) owns no vertex; use fewer servers/devices or \
             another partition",
            layout.server_of_rank(r),
            layout.device_of_rank(r)
        );
    }
    // Labels and splits by NEW id (only vertices with a valid label count, as in single mode).
    let mut old_to_new = vec![0u32; n];
    for (new, &old) in part.new_to_old.iter().enumerate() {
        old_to_new[old as usize] = new as u32;
    }
    let mut labelled_flags = vec![0u8; n];
    let mut totals = [0usize; 3];
    for (j, (ids, bit)) in [
        (view.train, SPLIT_TRAIN),
        (view.val, SPLIT_VAL),
        (view.test, SPLIT_TEST),
    ]
    .into_iter()
    .enumerate()
    {
        for &o in ids {
            let l = *view
                .labels
                .get(o as usize)
                .with_context(|| format!("split id {o} is out of range ({n} vertices)"))?;
            if l >= 0 && (l as usize) < view.num_classes {
                let f = &mut labelled_flags[old_to_new[o as usize] as usize];
                if *f & bit == 0 {
                    *f |= bit;
                    totals[j] += 1;
                }
            }
        }
    }
    if totals[0] == 0 {
        bail!("the dataset's train split has no labelled vertices");
    }
    let map = |ids: &[u32]| {
        ids.iter()
            .map(|&o| old_to_new[o as usize])
            .collect::<Vec<_>>()
    };
    let splits = SplitMembership::from_lists(n, &map(view.train), &map(view.val), &map(view.test))?;
    let ctx = PlanContext::new(part.graph.view(), layout.clone(), splits)?;

    let choice = choose_preload_hops(&ctx, &config, popts)?;
    for e in &choice.estimates {
        tracing::info!(
            "memory estimate k = {}: worst device (rank {}) {} bytes",
            e.k,
            e.worst_rank,
            e.max_bytes
        );
    }
    tracing::info!("preload hops: {}", choice.reason);
    let k = choice.k;
    let plan: PreloadPlan = ctx.preload_plan(k, config.layers)?;
    if !plan.reshape_is_identity_prefix() {
        bail!("internal: the FLX plan's inner rows are not the FB plan's owned prefix");
    }
    let dims = model_dims(&config);
    let estimate: KEstimate = plan.estimate(&dims);
    if let (Some(budget), Mode::Flx, Some(_)) =
        (popts.device_memory, popts.mode, popts.preload_hops)
    {
        if estimate.max_bytes > budget {
            tracing::warn!(
                "--preload-hops {k} needs an estimated {} bytes on rank {}, over the \
                 --device-memory budget of {budget} bytes",
                estimate.max_bytes,
                estimate.worst_rank
            );
        }
    }
    let replicated_vertices = plan
        .flx
        .as_ref()
        .map_or(0, |f| f.servers.iter().map(|s| s.replicated).sum());
    let predicted = predicted_halo_bytes(&plan, &config);
    let scales = global_scales(part.graph.view(), config.kind.aggregation());
    drop(ctx);

    let threads_per_rank = popts.threads_per_rank.unwrap_or_else(|| {
        (std::thread::available_parallelism().map_or(1, |c| c.get()) / ranks).max(1)
    });
    let shared = worker::Shared {
        view,
        new_to_old: &part.new_to_old,
        plan: &plan,
        scales: &scales,
        config: &config,
        opts,
        labelled_flags: &labelled_flags,
        totals,
        eval_every_epoch: popts.eval_every_epoch,
        collect_logits: popts.collect_logits,
        row_normalize: row_normalize(opts),
    };
    let callback: worker::EpochCallback<'_> = Mutex::new(on_epoch);
    // In-process: rank 0 reports epochs; one server's ranks: its first device does.
    let server_mode = local.is_some();
    let work = |ep: grandis_fabric::Endpoint| {
        let rank = ep.rank();
        let reports = if server_mode {
            ep.device() == 0
        } else {
            rank == 0
        };
        let backend = metered::Metered::new(CpuBackend::new(Some(threads_per_rank))?);
        let w = worker::Worker::new(&shared, &backend, ep)
            .with_context(|| format!("setting up rank {rank}"))?;
        w.run(&backend.meter, reports.then_some(&callback))
    };
    let results = match local {
        Some(endpoints) => server::run_endpoints(endpoints, work)?,
        None => Fabric::new(FabricConfig {
            servers,
            devices,
            intra: popts.intra,
            inter: popts.inter,
            ..FabricConfig::default()
        })?
        .run(work)?,
    };

    let r0 = &results[0];
    let epochs = opts.epochs.max(1);
    let counters = Counters::sum(results.iter().map(|r| &r.counters));
    let per_epoch = |phase: Phase, class: LinkClass| -> u64 {
        let total: u64 = counters
            .epochs
            .iter()
            .filter(|e| e.epoch & EVAL_EPOCH_BIT == 0)
            .flat_map(|e| e.links.iter())
            .filter(|r| r.phase == phase && r.class == class)
            .map(|r| r.bytes_sent)
            .sum();
        total / epochs as u64
    };
    let class_bytes = |phase: Phase| ClassBytes {
        intra_server: per_epoch(phase, LinkClass::IntraServer),
        inter_server: per_epoch(phase, LinkClass::InterServer),
    };
    let fwd = class_bytes(Phase::Forward);
    let bwd = class_bytes(Phase::Backward);
    let time = time_split(&results, opts.epochs);
    let mut logits = None;
    if popts.collect_logits {
        let c = config.classes;
        let mut all = vec![f32::NAN; n * c];
        for r in &results {
            for (o, row) in &r.logits {
                all[*o as usize * c..(*o as usize + 1) * c].copy_from_slice(row);
            }
        }
        logits = Some(all);
    }
    let memory = results
        .iter()
        .map(|r| RankMemory {
            rank: r.rank,
            measured_peak_bytes: r.peak_bytes,
            setup_bytes: r.setup_bytes,
            model_bytes: estimate.devices[r.rank].total,
        })
        .collect();
    let stats = r0.epochs.clone();
    let train = TrainReport {
        final_loss: stats.last().map_or(f64::NAN, |s| s.loss),
        train_acc: r0.final_acc[0],
        val_acc: r0.final_acc[1],
        test_acc: r0.final_acc[2],
        median_epoch_s: median(&stats.iter().map(|s| s.seconds).collect::<Vec<_>>()),
        first_epoch: 1,
        num_parameters: r0.num_parameters,
        epochs: stats,
    };
    Ok(ParallelReport {
        mode: popts.mode,
        servers,
        devices,
        partition: part.source.clone(),
        threads_per_rank,
        preload_hops: k,
        k_reason: choice.reason,
        k_estimates: choice
            .estimates
            .iter()
            .map(|e| (e.k, e.max_bytes))
            .collect(),
        replicated_vertices,
        halo_bytes_per_epoch: ClassBytes {
            intra_server: fwd.intra_server + bwd.intra_server,
            inter_server: fwd.inter_server + bwd.inter_server,
        },
        forward_bytes_per_epoch: fwd,
        backward_bytes_per_epoch: bwd,
        predicted_halo_bytes_per_epoch: predicted,
        all_reduce_bytes_per_epoch: class_bytes(Phase::AllReduce),
        time,
        memory,
        train,
        logits,
        counters,
    })
}

/// The plan's prediction of one epoch's halo traffic: the forward exchange feeding every
/// layer, plus the same rows back as gradients for every layer whose input gradient is needed
/// (all but layer 0 of sage/gcn, whose input is the features; ResSAGE+ needs layer 0's for its
/// encoder).
pub fn predicted_halo_bytes(plan: &PreloadPlan, config: &ModelConfig) -> ClassBytes {
    let dims = model_dims(config);
    let mut out = ClassBytes::default();
    for l in 0..plan.layers {
        let b = plan.forward_exchange_bytes(l, &dims);
        let times = if l > 0 || config.kind == ModelKind::ResSage {
            2
        } else {
            1
        };
        out.intra_server += times * b.intra;
        out.inter_server += times * b.inter;
    }
    out
}

fn time_split(results: &[worker::RankResult], epochs: usize) -> TimeSplit {
    let mut t = TimeSplit::default();
    let mut count = 0.0;
    // The first epoch warms caches and allocators; leave it out when there are others.
    let first = if epochs > 1 { 2 } else { 1 };
    for r in results {
        for e in first..=epochs {
            let wall = r.step_seconds[e - 1];
            let Some(c) = r.counters.epoch(e as u32) else {
                continue;
            };
            let calls = |phase: Phase| -> f64 {
                c.calls
                    .iter()
                    .filter(|x| x.phase == phase)
                    .map(|x| x.seconds)
                    .sum()
            };
            let exchange = calls(Phase::Forward) + calls(Phase::Backward);
            let inter_wait: f64 = c
                .links
                .iter()
                .filter(|x| {
                    x.class == LinkClass::InterServer
                        && matches!(x.phase, Phase::Forward | Phase::Backward)
                })
                .map(|x| x.wait_seconds)
                .sum();
            let all_reduce = calls(Phase::AllReduce);
            // The loss all-reduce runs after the timed step; it is reported but not part of it.
            let other = calls(Phase::Other);
            t.epoch_s += wall;
            t.inter_comm_s += inter_wait.min(exchange);
            t.intra_comm_s += (exchange - inter_wait).max(0.0);
            t.all_reduce_s += all_reduce;
            t.other_s += other;
            t.compute_s += (wall - exchange - all_reduce).max(0.0);
            count += 1.0;
        }
    }
    if count > 0.0 {
        for x in [
            &mut t.epoch_s,
            &mut t.compute_s,
            &mut t.intra_comm_s,
            &mut t.inter_comm_s,
            &mut t.all_reduce_s,
            &mut t.other_s,
        ] {
            *x /= count;
        }
    }
    t
}

/// Whether the trainer's options ask for row-normalised features. Read by field name through
/// serde: the option is newer than some trainer builds, and absent means off.
fn row_normalize(opts: &TrainOptions) -> bool {
    serde_json::to_value(opts)
        .ok()
        .and_then(|v| v.get("row_normalize").and_then(|b| b.as_bool()))
        .unwrap_or(false)
}

fn median(xs: &[f64]) -> f64 {
    if xs.is_empty() {
        return f64::NAN;
    }
    let mut v = xs.to_vec();
    v.sort_by(|a, b| a.total_cmp(b));
    let m = v.len() / 2;
    if v.len() % 2 == 1 {
        v[m]
    } else {
        0.5 * (v[m - 1] + v[m])
    }
}
