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
//!
//! Sampled and mini-batch modes (GraNNDIS §5.2, §5.3) run on the plans of `grandis-sampling`:
//! FLX-EAS (`Mode::Flx` with [`Sampling::Eas`]) swaps the exact FLX plan for an
//! expansion-aware sampled one, resampled every `resample_every` epochs; cooperative batching
//! (`Mode::Cob`) takes one optimiser step per iteration on one co-batch plan per server
//! (exact, EAS, layer-wise fanout or GraphSAINT), spread over the server's devices with
//! one-hop masking and intra-server exchanges only; the per-GPU mini-batch baseline
//! (`Mode::Mb`) gives every device its own standalone plan. Plans of later steps are built by
//! a producer thread while the ranks compute. Rows that aggregate over a sampled subset of
//! their in-edges are normalised by the kept count (`DevicePlan::agg_degree_at`), per layer
//! for layer-wise sampling. Sampled and mini-batch modes evaluate on the exact FB plan
//! (full-neighbourhood inference), and [`embeddings`] runs one forward pass on any masked
//! plan with given weights (exactness tests, `grandis analyze error`).

pub mod cli;
pub mod input;
pub mod metered;
pub mod server;
mod steps;
mod worker;

use std::sync::{Arc, Mutex};

use anyhow::{bail, Context};
use grandis_engine::norm::global_scales;
use grandis_engine::{Backend, CpuBackend};
use grandis_fabric::{Counters, Fabric, FabricConfig, LinkClass, Phase};
use grandis_masking::{
    DevicePlan, FlxPlan, KChoice, KEstimate, ModelDims, PlanContext, PreloadPlan, SplitMembership,
    SPLIT_TEST, SPLIT_TRAIN, SPLIT_VAL,
};
use grandis_models::{ModelConfig, ModelKind};
use grandis_sampling::{CoBatcher, Eas, Exact, Fanout, MiniBatcher, Saint, SaintKind, Sampler};
use grandis_store::DatasetView;
use grandis_trainer::{EpochStats, TrainOptions, TrainReport};
use serde::Serialize;

pub use grandis_fabric::LinkModel;
pub use grandis_masking::FlxPlan as MaskedPlan;
/// The samplers this runner executes (re-exported so front ends need no extra dependency).
pub use grandis_sampling as sampling;
pub use grandis_sampling::Priority;
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
    /// Cooperative batching: one co-batch MFG per server per iteration.
    Cob,
    /// Per-GPU mini-batches: one MFG per device per iteration, no sharing.
    Mb,
}

impl Mode {
    pub fn parse(s: &str) -> Option<Mode> {
        match s {
            "fb" => Some(Mode::Fb),
            "flx" => Some(Mode::Flx),
            "cob" => Some(Mode::Cob),
            "mb" => Some(Mode::Mb),
            _ => None,
        }
    }
    pub fn name(self) -> &'static str {
        match self {
            Mode::Fb => "fb",
            Mode::Flx => "flx",
            Mode::Cob => "cob",
            Mode::Mb => "mb",
        }
    }
}

/// Which dependency sampler a run uses (the seed is the training seed).
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
#[serde(tag = "sampler", rename_all = "lowercase")]
pub enum Sampling {
    /// Exact dependencies.
    None,
    /// Expansion-aware sampling: at most `fanout` external in-neighbours per vertex, external
    /// vertices at most `hops` hops from the server.
    Eas {
        hops: usize,
        fanout: usize,
        priority: Priority,
    },
    /// GraphSAGE layer-wise fanouts, hop 1 (the last layer) first.
    Fanout { fanouts: Vec<usize> },
    /// GraphSAINT per server per iteration with a budget of the co-batch size: the node
    /// sampler (`walk_length` None) or random walks of `walk_length` steps from
    /// `budget / (walk_length + 1)` roots.
    Saint { walk_length: Option<usize> },
}

impl Sampling {
    /// The dependency sampler (None for GraphSAINT, which samples targets too).
    pub fn sampler(&self, seed: u64) -> anyhow::Result<Option<Box<dyn Sampler>>> {
        Ok(match self {
            Sampling::None => Some(Box::new(Exact)),
            Sampling::Eas {
                hops,
                fanout,
                priority,
            } => Some(Box::new(Eas::new(*hops, *fanout, *priority, seed)?)),
            Sampling::Fanout { fanouts } => Some(Box::new(Fanout::new(fanouts.clone(), seed)?)),
            Sampling::Saint { .. } => None,
        })
    }

    /// The GraphSAINT sampler for a per-server budget.
    pub fn saint(&self, budget: usize, seed: u64) -> Option<Saint> {
        match self {
            Sampling::Saint { walk_length } => Some(Saint {
                kind: match walk_length {
                    None => SaintKind::Node { budget },
                    Some(len) => SaintKind::RandomWalk {
                        roots: (budget / (len + 1)).max(1),
                        length: *len,
                    },
                },
                seed,
            }),
            _ => None,
        }
    }

    pub fn is_none(&self) -> bool {
        matches!(self, Sampling::None)
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
    /// Dependency sampling (FLX: EAS or fanout; CoB: any; MB: none, EAS or fanout).
    pub sampling: Sampling,
    /// CoB: co-batch size per server; MB: mini-batch size per device.
    pub batch_size: Option<usize>,
    /// FLX-EAS: draw a new sample every N epochs (None or 0: sample once).
    pub resample_every: Option<u64>,
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
            sampling: Sampling::None,
            batch_size: None,
            resample_every: None,
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
    /// Vertices replicated by FLX preloading over all servers (per-step plans: mean per step).
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
    /// The sampler's name ("exact", "eas(h=1,f=15,degree)", "sage(25,10,5)", "saint(...)").
    pub sampling: String,
    /// CoB co-batch size / MB mini-batch size.
    pub batch_size: Option<usize>,
    pub iterations_per_epoch: usize,
    /// Labelled loss rows per epoch (sum over steps).
    pub targets_per_epoch: u64,
    /// Edges of the one-hop graphs the ranks hold, summed over the steps of an epoch.
    pub sampled_edges: u64,
    /// Rows computed at each layer, summed over ranks and the steps of an epoch.
    pub computed_vertices_per_layer: Vec<u64>,
    pub computed_vertex_layers: u64,
    /// Edges aggregated at each layer per epoch.
    pub aggregated_edges_per_layer: Vec<u64>,
    /// Boundary ratio β of every server (§5.3.2), mean over the steps.
    pub beta: Vec<f64>,
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
        (Mode::Cob | Mode::Mb, _) => bail!(
            "--mode {} runs every layer on its per-iteration plans; preloading is for --mode flx",
            popts.mode.name()
        ),
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

/// Labelled-vertex flags (`SPLIT_*` by NEW id, only vertices with a valid label) and the
/// labelled train / val / test totals.
fn labelled(
    view: &DatasetView<'_>,
    part: &PartitionedGraph,
) -> anyhow::Result<(Vec<u8>, [usize; 3])> {
    let n = view.num_vertices();
    let mut old_to_new = vec![0u32; n];
    for (new, &old) in part.new_to_old.iter().enumerate() {
        old_to_new[old as usize] = new as u32;
    }
    let mut flags = vec![0u8; n];
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
                let f = &mut flags[old_to_new[o as usize] as usize];
                if *f & bit == 0 {
                    *f |= bit;
                    totals[j] += 1;
                }
            }
        }
    }
    Ok((flags, totals))
}

/// The planning context of a partitioned dataset: the relabelled graph, its layout and the
/// LABELLED split membership (so co-batches and mini-batches only draw vertices that carry a
/// loss).
pub fn plan_context<'a>(
    view: &DatasetView<'_>,
    part: &'a PartitionedGraph,
) -> anyhow::Result<PlanContext<'a>> {
    let n = view.num_vertices();
    if part.graph.view().num_vertices() != n || part.new_to_old.len() != n {
        bail!(
            "the partitioned graph has {} vertices, the dataset {n}",
            part.graph.view().num_vertices()
        );
    }
    let (flags, _) = labelled(view, part)?;
    let ids = |bit: u8| -> Vec<u32> {
        (0..n as u32)
            .filter(|&v| flags[v as usize] & bit != 0)
            .collect()
    };
    let splits =
        SplitMembership::from_lists(n, &ids(SPLIT_TRAIN), &ids(SPLIT_VAL), &ids(SPLIT_TEST))?;
    Ok(PlanContext::new(
        part.graph.view(),
        part.layout.clone(),
        splits,
    )?)
}

/// Checks that `view`, `part` and `config` belong together.
fn check_inputs(
    view: &DatasetView<'_>,
    part: &PartitionedGraph,
    config: &ModelConfig,
) -> anyhow::Result<()> {
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
    let layout = &part.layout;
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
    Ok(())
}

/// The per-device budget of a run and where it came from.
fn budget(popts: &ParallelOptions, ranks: usize) -> anyhow::Result<(u64, String)> {
    Ok(match popts.device_memory {
        Some(b) => (b, "--device-memory".to_string()),
        None => (
            default_device_memory(ranks)?,
            format!("available system memory / {ranks} ranks on this machine"),
        ),
    })
}

/// FLX with a sampler: the largest k whose sampled FLX plan (over the FB plan) fits the
/// budget, built from k = L downwards (sampled plans are small, and the first that fits wins).
fn choose_sampled_k(
    ctx: &PlanContext<'_>,
    dims: &ModelDims,
    fb: &grandis_masking::FbPlan,
    sampler: &dyn Sampler,
    popts: &ParallelOptions,
) -> anyhow::Result<KChoice> {
    let (budget, from) = budget(popts, ctx.layout().num_ranks())?;
    let mut estimates = Vec::new();
    for k in (1..=dims.layers).rev() {
        let flx = steps::flx_sampled(ctx, sampler, k, 0)?;
        let e = grandis_masking::estimate(dims, fb, Some(&flx));
        let fits = e.max_bytes <= budget;
        let (bytes, rank) = (e.max_bytes, e.worst_rank);
        estimates.push(e);
        if fits {
            estimates.reverse();
            return Ok(KChoice {
                k,
                estimates,
                reason: format!(
                    "k = {k} with {}: worst device (rank {rank}) needs {bytes} bytes of the \
                     {budget}-byte budget (from {from})",
                    sampler.name()
                ),
            });
        }
    }
    bail!(
        "no k >= 1 fits the {budget}-byte per-device budget ({from}) with {}; the smallest \
         sampled FLX plan (k = 1) needs {} bytes: use --mode cob",
        sampler.name(),
        estimates.last().map_or(0, |e| e.max_bytes)
    )
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
    check_inputs(&view, part, &config)?;
    let n = view.num_vertices();
    let layout = part.layout.clone();
    let (servers, devices) = (layout.servers(), layout.devices());
    let ranks = layout.num_ranks();
    let (labelled_flags, totals) = labelled(&view, part)?;
    if totals[0] == 0 {
        bail!("the dataset's train split has no labelled vertices");
    }
    let ctx = plan_context(&view, part)?;
    let dims = model_dims(&config);
    let seed = opts.seed;
    let epochs = opts.epochs.max(1);
    let is_train = |g: u32| labelled_flags[g as usize] & SPLIT_TRAIN != 0;

    // Samplers outlive the schedule that borrows them.
    let sampler = popts.sampling.sampler(seed)?;
    let batch_size = || -> anyhow::Result<usize> {
        match popts.batch_size {
            Some(b) if b > 0 => Ok(b),
            Some(_) => bail!("the batch size must be at least 1"),
            None => bail!(
                "--mode {} needs a batch size (--cobatch-size for cob, --batch-size for mb)",
                popts.mode.name()
            ),
        }
    };
    let mut choice = KChoice {
        k: config.layers,
        estimates: Vec::new(),
        reason: String::new(),
    };
    let mut predicted = ClassBytes::default();
    let mut replicated_vertices = 0;
    let mut eval_plans: Option<Vec<Vec<Arc<DevicePlan>>>> = None;
    let fb_arcs = |fb: grandis_masking::FbPlan| -> Vec<Arc<DevicePlan>> {
        fb.devices.into_iter().map(Arc::new).collect()
    };
    let per_layer = |fb: &[Arc<DevicePlan>]| -> Vec<Vec<Arc<DevicePlan>>> {
        fb.iter().map(|d| vec![d.clone(); config.layers]).collect()
    };
    if let (Mode::Cob | Mode::Mb, Some(k)) = (popts.mode, popts.preload_hops) {
        bail!(
            "--preload-hops {k}: --mode {} runs every layer on its per-iteration plans; \
             preloading is for --mode flx",
            popts.mode.name()
        );
    }
    let schedule: steps::Schedule<'_> = match (popts.mode, &popts.sampling) {
        (Mode::Fb | Mode::Flx, Sampling::None) => {
            choice = choose_preload_hops(&ctx, &config, popts)?;
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
            replicated_vertices = plan
                .flx
                .as_ref()
                .map_or(0, |f| f.servers.iter().map(|s| s.replicated).sum());
            predicted = predicted_halo_bytes(&plan, &config);
            let (step, stats) =
                steps::static_step(&ctx, plan.fb.devices, plan.flx, k, &dims, &is_train);
            steps::Schedule::Static { step, stats }
        }
        (Mode::Fb, s) => bail!(
            "--mode fb trains on the exact graph; --sampling {} needs --mode flx, cob or mb",
            sampling_flag(s)
        ),
        (Mode::Flx, Sampling::Saint { .. }) => {
            bail!("GraphSAINT samples a subgraph per iteration: use --mode cob --sampling saint")
        }
        (Mode::Flx, _) => {
            let sampler = sampler.as_deref().context("a dependency sampler")?;
            let fb = ctx.fb_plan()?;
            choice = match popts.preload_hops {
                Some(k) if k == 0 || k > config.layers => bail!(
                    "--preload-hops {k}: FLX with sampling needs 1 <= k <= {} layers",
                    config.layers
                ),
                Some(k) => KChoice {
                    k,
                    estimates: Vec::new(),
                    reason: format!(
                        "k = {k} fixed by --preload-hops, sampled with {}",
                        sampler.name()
                    ),
                },
                None => choose_sampled_k(&ctx, &dims, &fb, sampler, popts)?,
            };
            tracing::info!("preload hops: {}", choice.reason);
            let fb = fb_arcs(fb);
            eval_plans = Some(per_layer(&fb));
            steps::Schedule::FlxSampled {
                k: choice.k,
                fb,
                sampler,
                every: popts.resample_every,
            }
        }
        (Mode::Cob, s) => {
            let b = batch_size()?;
            let batcher = CoBatcher::new(&ctx, b, seed)?;
            let sampler = match s {
                Sampling::Saint { .. } => steps::CobSampler::Saint(
                    popts.sampling.saint(b, seed).context("saint sampler")?,
                ),
                _ => steps::CobSampler::Deps(sampler.as_deref().context("a dependency sampler")?),
            };
            choice.reason = format!(
                "cooperative batching: co-batches of at most {b} per server, {} iterations per \
                 epoch, every layer masked",
                batcher.iterations()
            );
            eval_plans = Some(per_layer(&fb_arcs(ctx.fb_plan()?)));
            steps::Schedule::Cob { batcher, sampler }
        }
        (Mode::Mb, Sampling::Saint { .. }) => {
            bail!("GraphSAINT is server-wise here: use --mode cob --sampling saint")
        }
        (Mode::Mb, _) => {
            let b = batch_size()?;
            let batcher = MiniBatcher::new(&ctx, b, seed)?;
            choice.reason = format!(
                "per-GPU mini-batches of at most {b} per device, {} iterations per epoch",
                batcher.iterations()
            );
            eval_plans = Some(per_layer(&fb_arcs(ctx.fb_plan()?)));
            steps::Schedule::Mb {
                batcher,
                sampler: sampler.as_deref().context("a dependency sampler")?,
            }
        }
    };
    let iterations = schedule.iterations();
    if iterations == 0 {
        bail!("no training vertex to batch: the train split is empty");
    }
    let sampling_name = match (&popts.sampling, &schedule) {
        (
            _,
            steps::Schedule::Cob {
                sampler: steps::CobSampler::Saint(s),
                ..
            },
        ) => {
            format!("saint({:?})", s.kind)
        }
        _ => sampler.as_ref().map_or("exact".into(), |s| s.name()),
    };
    let scales = global_scales(part.graph.view(), config.kind.aggregation());

    let threads_per_rank = popts.threads_per_rank.unwrap_or_else(|| {
        (std::thread::available_parallelism().map_or(1, |c| c.get()) / ranks).max(1)
    });
    let is_static = matches!(schedule, steps::Schedule::Static { .. });
    // Every step is kept until each rank run HERE took it.
    let local_ranks = local.as_ref().map_or(ranks, Vec::len);
    let feed = steps::Feed::new(local_ranks, if is_static { epochs } else { PREFETCH_STEPS });
    let run_stats = Mutex::new(steps::RunStats::default());
    let shared = worker::Shared {
        view,
        new_to_old: &part.new_to_old,
        scales: &scales,
        agg: config.kind.aggregation(),
        config: &config,
        opts,
        labelled_flags: &labelled_flags,
        totals,
        eval_every_epoch: popts.eval_every_epoch,
        collect_logits: popts.collect_logits,
        row_normalize: row_normalize(opts),
        feed: &feed,
        iterations,
        eval: eval_plans.as_deref(),
        weights: None,
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
    let run_all = |work| -> anyhow::Result<Vec<worker::RankResult>> {
        match local {
            Some(endpoints) => server::run_endpoints(endpoints, work),
            None => Fabric::new(FabricConfig {
                servers,
                devices,
                intra: popts.intra,
                inter: popts.inter,
                ..FabricConfig::default()
            })?
            .run(work),
        }
    };
    let results = if let steps::Schedule::Static { step, stats } = &schedule {
        // One plan for every epoch: hand it out up front and free the planning context (its
        // transposed graph) before training.
        for e in 0..epochs as u64 {
            feed.push(e, step.clone());
            if let Ok(mut s) = run_stats.lock() {
                s.add(stats);
            }
        }
        drop(ctx);
        run_all(work)
    } else {
        std::thread::scope(|scope| {
            let producer = std::thread::Builder::new()
                .name("grandis-plans".into())
                .spawn_scoped(scope, || {
                    steps::produce(&ctx, &schedule, &dims, epochs, &feed, &run_stats, &is_train)
                })
                .context("starting the plan producer thread")?;
            let r = run_all(work);
            feed.close();
            if producer.join().is_err() {
                bail!("the plan producer thread panicked");
            }
            r
        })
    }?;

    let r0 = &results[0];
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
    let rs = run_stats
        .into_inner()
        .map_err(|_| anyhow::anyhow!("run statistics poisoned"))?;
    let memory = results
        .iter()
        .map(|r| RankMemory {
            rank: r.rank,
            measured_peak_bytes: r.peak_bytes,
            setup_bytes: r.setup_bytes,
            model_bytes: rs.model_peak.get(r.rank).copied().unwrap_or(0),
        })
        .collect();
    let per_ep = |x: u64| x / epochs as u64;
    let steps_n = rs.steps.max(1) as f64;
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
    let computed: Vec<u64> = rs.computed_per_layer.iter().map(|&x| per_ep(x)).collect();
    Ok(ParallelReport {
        mode: popts.mode,
        servers,
        devices,
        partition: part.source.clone(),
        threads_per_rank,
        preload_hops: choice.k,
        k_reason: choice.reason,
        k_estimates: choice
            .estimates
            .iter()
            .map(|e| (e.k, e.max_bytes))
            .collect(),
        // Static plans: the FLX plan's; per-step plans: the mean over steps.
        replicated_vertices: if is_static {
            replicated_vertices
        } else {
            (rs.replicated as f64 / steps_n).round() as usize
        },
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
        sampling: sampling_name,
        batch_size: popts
            .batch_size
            .filter(|_| matches!(popts.mode, Mode::Cob | Mode::Mb)),
        iterations_per_epoch: iterations,
        targets_per_epoch: per_ep(rs.targets),
        sampled_edges: per_ep(rs.sampled_edges),
        computed_vertex_layers: computed.iter().sum(),
        computed_vertices_per_layer: computed,
        aggregated_edges_per_layer: rs
            .aggregated_edges_per_layer
            .iter()
            .map(|&x| per_ep(x))
            .collect(),
        beta: rs.beta_sum.iter().map(|b| b / steps_n).collect(),
        train,
        logits,
        counters,
    })
}

/// Steps the plan producer may build ahead of the slowest rank.
const PREFETCH_STEPS: usize = 2;

fn sampling_flag(s: &Sampling) -> &'static str {
    match s {
        Sampling::None => "none",
        Sampling::Eas { .. } => "eas",
        Sampling::Fanout { .. } => "fanout",
        Sampling::Saint { .. } => "saint",
    }
}

/// Per-layer and final outputs of one forward pass, in ORIGINAL vertex order.
#[derive(Debug, Clone)]
pub struct Embeddings {
    /// `layers[l]`: `n x widths[l]` outputs of conv layer l (after its activation; the
    /// logits for the last layer of sage/gcn). Rows of vertices that were no target are NaN.
    pub layers: Vec<Vec<f32>>,
    pub widths: Vec<usize>,
    /// `n x classes` model outputs (NaN rows for non-targets).
    pub logits: Vec<f32>,
    /// Which vertices were targets (computed).
    pub computed: Vec<bool>,
}

/// One forward pass (dropout off) over the partition-parallel runner: on the exact FB plan
/// (`plan` None), or on a masked plan whose every layer is masked (`plan.k` = the model's
/// layers: a co-batch, EAS, fanout or SAINT plan built over [`plan_context`] of the same
/// `part`). `weights` (model parameter order, e.g. from [`checkpoint_weights`]) replace the
/// seeded initialisation. Only the plan's targets (inner rows) get outputs.
pub fn embeddings(
    view: DatasetView<'_>,
    part: &PartitionedGraph,
    config: &ModelConfig,
    weights: Option<&[Vec<f32>]>,
    plan: Option<FlxPlan>,
    threads_per_rank: Option<usize>,
) -> anyhow::Result<Embeddings> {
    check_inputs(&view, part, config)?;
    let n = view.num_vertices();
    let layout = &part.layout;
    let ranks = layout.num_ranks();
    let (labelled_flags, totals) = labelled(&view, part)?;
    let per_rank: Vec<Vec<Arc<DevicePlan>>> = match plan {
        Some(p) => {
            if p.k != config.layers || p.devices.len() != ranks {
                bail!(
                    "the plan has {} masked layers over {} devices; the model has {} layers \
                     and the layout {ranks} devices",
                    p.k,
                    p.devices.len(),
                    config.layers
                );
            }
            p.devices
                .into_iter()
                .map(|d| steps::every_layer(d, config.layers))
                .collect()
        }
        None => {
            let ctx = plan_context(&view, part)?;
            ctx.fb_plan()?
                .devices
                .into_iter()
                .map(|d| steps::every_layer(d, config.layers))
                .collect()
        }
    };
    let feed = steps::Feed::new(ranks, 1);
    feed.push(
        0,
        Arc::new(steps::Step {
            plans: per_rank,
            targets: 0,
        }),
    );
    let scales = global_scales(part.graph.view(), config.kind.aggregation());
    let opts: TrainOptions = serde_json::from_value(serde_json::json!({
        "epochs": 0, "lr": 0.0, "weight_decay": 0.0, "adamw": false, "grad_clip": null, "seed": 0
    }))?;
    let shared = worker::Shared {
        view,
        new_to_old: &part.new_to_old,
        scales: &scales,
        agg: config.kind.aggregation(),
        config,
        opts: &opts,
        labelled_flags: &labelled_flags,
        totals,
        eval_every_epoch: false,
        collect_logits: false,
        row_normalize: false,
        feed: &feed,
        iterations: 1,
        eval: None,
        weights,
    };
    let threads = threads_per_rank.unwrap_or_else(|| {
        (std::thread::available_parallelism().map_or(1, |c| c.get()) / ranks).max(1)
    });
    let fabric = Fabric::new(FabricConfig {
        servers: layout.servers(),
        devices: layout.devices(),
        ..FabricConfig::default()
    })?;
    let results = fabric.run(|ep| {
        let backend = CpuBackend::new(Some(threads))?;
        worker::Worker::new(&shared, &backend, ep)?.embed()
    })?;
    let model = grandis_models::Model::new(&CpuBackend::new(Some(1))?, config.clone())?;
    let first_conv = usize::from(config.kind == ModelKind::ResSage);
    let widths: Vec<usize> = (0..config.layers)
        .map(|l| model.stage_dims(first_conv + l).1)
        .collect();
    let c = config.classes;
    let mut layers: Vec<Vec<f32>> = widths.iter().map(|&w| vec![f32::NAN; n * w]).collect();
    let mut logits = vec![f32::NAN; n * c];
    let mut computed = vec![false; n];
    for r in &results {
        for (i, &o) in r.ids.iter().enumerate() {
            let o = o as usize;
            computed[o] = true;
            logits[o * c..(o + 1) * c].copy_from_slice(&r.logits[i * c..(i + 1) * c]);
            for (l, &w) in widths.iter().enumerate() {
                let src = r.layers.get(l).context("a captured layer")?;
                layers[l][o * w..(o + 1) * w].copy_from_slice(&src[i * w..(i + 1) * w]);
            }
        }
    }
    Ok(Embeddings {
        layers,
        widths,
        logits,
        computed,
    })
}

/// The model configuration and host weights (parameter order) of a trainer checkpoint.
pub fn checkpoint_weights(path: &std::path::Path) -> anyhow::Result<(ModelConfig, Vec<Vec<f32>>)> {
    let ck = grandis_trainer::load_checkpoint(path)?;
    let b = CpuBackend::new(Some(1))?;
    let mut model = grandis_models::Model::new(&b, ck.model.clone())?;
    ck.restore(&b, &mut model, false)
        .with_context(|| format!("restoring checkpoint {}", path.display()))?;
    let weights = model
        .params
        .iter()
        .map(|p| {
            let mut host = vec![0f32; p.len()];
            b.download(&p.value, 0, &mut host).map(|_| host)
        })
        .collect::<grandis_engine::Result<Vec<_>>>()?;
    Ok((ck.model, weights))
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
