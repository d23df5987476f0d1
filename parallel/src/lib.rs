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
//! single-process trainer's (`grandis-trainer`) up to float summation order. A server holds
//! only its partition's features: the rows a masked plan replicates from another server are
//! fetched from their home rank whenever a rank builds a step's plans (`fetch`), and reported
//! per epoch, or once as setup for a plan that serves the whole run. Each rank's backend
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

mod auto;
mod budget;
mod embed;
mod fetch;
pub mod input;
pub mod metered;
mod options;
mod report;
mod runtime;
pub mod server;
mod setup;
mod steps;
mod worker;

use std::sync::{Arc, Mutex};

use anyhow::{bail, Context};
use grandis_engine::norm::global_scales;
use grandis_engine::CpuBackend;
use grandis_fabric::{Counters, Fabric, FabricConfig, Phase};
use grandis_masking::{DevicePlan, KChoice, PreloadPlan, SPLIT_TRAIN};
use grandis_models::ModelConfig;
use grandis_sampling::{CoBatcher, MiniBatcher};
use grandis_store::DatasetView;
use grandis_trainer::{EpochStats, TrainOptions, TrainReport};

pub use auto::decide_auto;
pub use budget::{
    choose_preload_hops, default_budget, default_device_memory, model_dims, predicted_halo_bytes,
};
pub use embed::{checkpoint_weights, embeddings, Embeddings};
pub use grandis_fabric::LinkModel;
pub use grandis_masking::FlxPlan as MaskedPlan;
/// The samplers this runner executes (re-exported so front ends need no extra dependency).
pub use grandis_sampling as sampling;
pub use grandis_wire::{LinkBytes, Mode, Priority, RankMemory, Sampling, TimeSplit};
pub use input::PartitionedGraph;
pub use options::{Compute, ParallelOptions};
pub use report::ParallelReport;
pub use setup::plan_context;
pub use worker::EVAL_EPOCH_BIT;

use budget::choose_sampled_k;
use report::time_split;
use setup::{check_inputs, labelled};

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
    let (resolved, auto) = auto::resolve_mode(&view, part, &config, popts, opts.seed)?;
    let popts = &resolved;
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
    let sampler = grandis_sampling::dependency_sampler(&popts.sampling, config.layers, seed)?;
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
    let mut predicted = LinkBytes::default();
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
            s.method()
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
                    grandis_sampling::saint_sampler(&popts.sampling, b, seed)
                        .context("saint sampler")?,
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
        (Mode::Single | Mode::Auto, _) => {
            bail!(
                "internal: mode {} reached the planner unresolved",
                popts.mode
            )
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
    let scales = global_scales(part.graph.view(), grandis_models::aggregation(config.kind));

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
        layout: &part.layout,
        scales: &scales,
        agg: grandis_models::aggregation(config.kind),
        config: &config,
        opts,
        labelled_flags: &labelled_flags,
        totals,
        eval_every_epoch: popts.eval_every_epoch,
        collect_logits: popts.collect_logits,
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
        let callback = reports.then_some(&callback);
        match &popts.compute {
            Compute::Cpu => {
                let backend = CpuBackend::new(Some(threads_per_rank))?;
                run_rank(&shared, backend, ep, callback)
            }
            #[cfg(feature = "cuda")]
            Compute::Cuda { .. } => {
                let backend = cuda_rank_backend(&popts.compute, &ep)?;
                run_rank(&shared, backend, ep, callback)
            }
            // Without the `cuda` feature the backend type is uninhabited: this arm cannot run.
            #[cfg(not(feature = "cuda"))]
            Compute::Cuda { .. } => match cuda_rank_backend(&popts.compute, &ep)? {},
        }
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
    if let steps::Schedule::Static { stats, .. } = &schedule {
        budget::check_budget(popts.device_memory, &stats.model_bytes, "the plan")?;
    }
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
                    steps::produce(
                        &ctx,
                        &schedule,
                        &dims,
                        epochs,
                        popts.device_memory,
                        &feed,
                        &run_stats,
                        &is_train,
                    )
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
    let class_bytes = |phase: Phase| report::class_bytes_per_epoch(&counters, phase, epochs);
    let fwd = class_bytes(Phase::Forward);
    let bwd = class_bytes(Phase::Backward);
    let time = time_split(&results, opts.epochs);
    // The plan built before the first epoch serves the whole run unless plans change per
    // iteration (cob, mb) or FLX-EAS draws more than one sample in the run.
    let first_plan_recurs = match &schedule {
        steps::Schedule::Static { .. } => false,
        steps::Schedule::FlxSampled { every, .. } => {
            every.is_some_and(|n| n > 0 && epochs as u64 > n)
        }
        steps::Schedule::Cob { .. } | steps::Schedule::Mb { .. } => true,
    };
    let (fetch_bytes_per_epoch, setup_fetch_bytes) =
        report::fetch_bytes(&counters, epochs, first_plan_recurs);
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
        median_epoch_s: grandis_telemetry::median(
            &stats.iter().map(|s| s.seconds).collect::<Vec<_>>(),
        ),
        first_epoch: 1,
        num_parameters: r0.num_parameters,
        epochs: stats,
    };
    let computed: Vec<u64> = rs.computed_per_layer.iter().map(|&x| per_ep(x)).collect();
    Ok(ParallelReport {
        mode: popts.mode,
        auto,
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
        halo_bytes_per_epoch: LinkBytes {
            intra_server: fwd.intra_server + bwd.intra_server,
            inter_server: fwd.inter_server + bwd.inter_server,
        },
        forward_bytes_per_epoch: fwd,
        backward_bytes_per_epoch: bwd,
        predicted_halo_bytes_per_epoch: predicted,
        all_reduce_bytes_per_epoch: class_bytes(Phase::AllReduce),
        fetch_bytes_per_epoch,
        setup_fetch_bytes,
        time,
        memory,
        sampling: sampling_name,
        batch_size: popts.batch_size.filter(|_| popts.mode.is_mini_batch()),
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

/// Sets up and runs one rank on `backend` (wrapped in the byte meter).
fn run_rank<B: grandis_engine::Backend>(
    shared: &worker::Shared<'_>,
    backend: B,
    ep: grandis_fabric::Endpoint,
    callback: Option<&worker::EpochCallback<'_>>,
) -> anyhow::Result<worker::RankResult> {
    let rank = ep.rank();
    let backend = metered::Metered::new(backend);
    let w = worker::Worker::new(shared, &backend, ep)
        .with_context(|| format!("setting up rank {rank}"))?;
    w.run(&backend.meter, callback)
}

/// The CUDA backend of the rank behind `ep`: its device index inside the server picks the
/// ordinal ([`Compute::ordinal`]).
#[cfg(feature = "cuda")]
fn cuda_rank_backend(
    compute: &Compute,
    ep: &grandis_fabric::Endpoint,
) -> anyhow::Result<grandis_engine::cuda::CudaBackend> {
    let available = grandis_engine::cuda::device_count()?;
    let ordinal = compute.ordinal(ep.device(), available).unwrap_or(0);
    grandis_engine::cuda::CudaBackend::new(ordinal)
        .with_context(|| format!("rank {} on cuda:{ordinal}", ep.rank()))
}

#[cfg(not(feature = "cuda"))]
fn cuda_rank_backend(
    _: &Compute,
    _: &grandis_fabric::Endpoint,
) -> anyhow::Result<std::convert::Infallible> {
    bail!("this grandis was built without CUDA support; rebuild with `--features cuda`")
}

/// Steps the plan producer may build ahead of the slowest rank.
const PREFETCH_STEPS: usize = 2;
