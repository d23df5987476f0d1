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
//! fabric's hierarchical, bit-identical all-reduce, so all ranks keep identical weights. CUDA
//! ranks move halo rows and gradients on device transports instead ([`links`]: NCCL, or
//! device copies between ranks that share a GPU), in the same order and with the same counts. Every
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

pub mod auto;
mod budget;
mod decide;
mod embed;
mod feed;
mod fetch;
pub mod infer;
pub mod input;
pub mod links;
pub mod measure;
pub mod metered;
mod options;
pub mod planner;
mod prepare;
mod report;
mod run;
mod runtime;
pub mod server;
mod setup;
mod stale;
pub mod step_bench;
mod steps;
mod worker;

use anyhow::bail;
use grandis_models::ModelConfig;
use grandis_store::DatasetView;
use grandis_trainer::{EpochStats, TrainOptions};

pub use budget::{
    choose_preload_hops, default_budget, default_device_memory, model_dims, predicted_halo_bytes,
};
pub use embed::{checkpoint_weights, embeddings, Embeddings};
pub use grandis_fabric::LinkModel;
pub use grandis_masking::FlxPlan as MaskedPlan;
/// The samplers this runner executes (re-exported so front ends need no extra dependency).
pub use grandis_sampling as sampling;
pub use grandis_wire::{LinkBytes, Mode, Priority, RankMemory, Sampling, TimeSplit};
pub use input::{PartGraph, PartitionedGraph};

/// Whether this build has the CUDA backend (the `cuda` feature): configurations that name a
/// CUDA device are refused up front without it.
pub const CUDA_BUILT: bool = cfg!(feature = "cuda");

/// What every front end says when asked for CUDA in a build without it.
pub const NOT_BUILT_WITH_CUDA: &str =
    "this grandis was built without CUDA support; rebuild with `--features cuda`";
pub use options::{cores_per_rank, Compute, ParallelOptions};
pub use report::ParallelReport;
pub use setup::plan_context;
pub use worker::EVAL_EPOCH_BIT;

use setup::{check_inputs, in_train_split, labelled};

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
/// The three stages: the mode and sampling decision (`decide`), the run (`run`), the report.
pub(crate) fn train_ranks(
    view: DatasetView<'_>,
    part: &PartitionedGraph,
    config: ModelConfig,
    opts: &TrainOptions,
    popts: &ParallelOptions,
    on_epoch: &mut (dyn FnMut(&EpochStats) + Send),
    mut local: Option<Vec<grandis_fabric::Endpoint>>,
) -> anyhow::Result<ParallelReport> {
    check_inputs(&view, part, &config)?;
    let (popts, plan) =
        auto::resolve_mode(&view, part, &config, popts, opts.seed, local.as_deref_mut())?;
    if popts.staleness.is_some() && !matches!(popts.mode, Mode::Fb | Mode::Flx) {
        bail!(
            "staleness bounds the full-batch halo exchange of modes fb and flx; mode {} has none \
             to skip",
            popts.mode
        );
    }
    if popts.remote_features.is_some() && !popts.mode.is_mini_batch() {
        bail!(
            "remote features samples the features fetched per step in modes cob, mb and \
             cluster; mode {} fetches them once",
            popts.mode
        );
    }
    let resume = popts.checkpoint.resume_from(&config, opts)?;
    if let Some(ck) = &resume {
        if ck.epochs_done == opts.epochs && popts.infer.is_some() {
            tracing::info!(
                "the checkpoint holds all {} epochs: predicting without training",
                ck.epochs_done
            );
            return infer::predict_only(view, part, &config, ck, &popts, local);
        }
        if ck.epochs_done >= opts.epochs {
            bail!(
                "the checkpoint already holds {} epochs and the run asks for {}: raise --epochs \
                 to train further",
                ck.epochs_done,
                opts.epochs
            );
        }
    }
    let (labelled_flags, totals) = labelled(&view, part)?;
    if totals[0] == 0 {
        bail!("the dataset's train split has no labelled vertices");
    }
    let ctx = plan_context(&view, part)?;
    let dims = model_dims(&config);
    // The sampler outlives the schedule that borrows it.
    let sampler = grandis_sampling::dependency_sampler(&popts.sampling, config.layers, opts.seed)?;
    let decision = decide::decide(
        &ctx,
        &config,
        &popts,
        &dims,
        sampler.as_deref(),
        &|g| in_train_split(&labelled_flags, g),
        opts.seed,
    )?;
    if decision.schedule.iterations() == 0 {
        bail!("no training vertex to batch: the train split is empty");
    }
    let inputs = run::RunInputs {
        view,
        part,
        config: &config,
        opts,
        popts: &popts,
        labelled_flags: &labelled_flags,
        totals,
        dims: &dims,
        decision: &decision,
        resume: resume.as_ref(),
    };
    run::run(inputs, ctx, on_epoch, local)?.report(
        &decision,
        &popts,
        plan,
        part,
        config.classes,
        opts,
    )
}
