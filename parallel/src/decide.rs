//! The mode and sampling decision of a run, taken before any rank starts: which [`Schedule`]
//! makes its steps (one static FB / exact FLX plan, FLX-EAS resampling, co-batches or
//! mini-batches), the preload depth k and why, what sampled and batched modes evaluate on,
//! and what the static plan predicts the halo traffic to be.

use std::sync::Arc;

use anyhow::{bail, Context};
use grandis_masking::{DevicePlan, KChoice, PreloadPlan};
use grandis_models::ModelConfig;
use grandis_sampling::{ClusterBatches, CoBatcher, MiniBatcher, Sampler};
use grandis_wire::{LinkBytes, Mode, Sampling};

use crate::budget::{choose_preload_hops, choose_sampled_k, predicted_halo_bytes};
use crate::steps::{self, CobSampler, Schedule, StepInputs};
use crate::ParallelOptions;

/// Clusters in one cluster batch per server (`--mode cluster`): a batch of `batch_size`
/// vertices is this many METIS clusters of `batch_size / CLUSTERS_PER_BATCH`, drawn afresh each
/// epoch, so batches vary between epochs (Cluster-GCN's stochastic multiple partitions).
const CLUSTERS_PER_BATCH: usize = 8;

/// What a run trains on, decided from its (resolved) options.
pub(crate) struct Decision<'s> {
    pub schedule: Schedule<'s>,
    /// The preload depth k and why (the budget's estimates, a fixed `--preload-hops`, or the
    /// batching mode's description).
    pub choice: KChoice,
    /// The static plan's predicted halo bytes per epoch (zero for per-step plans).
    pub predicted: LinkBytes,
    /// Vertices the static FLX plan replicates over all servers.
    pub replicated_vertices: usize,
    /// What evaluation runs on.
    pub eval: Eval,
    /// The sampler's name for the report ("exact", "eas(...)", "saint(...)").
    pub sampling: String,
}

impl Decision<'_> {
    /// Whether one plan serves every epoch (FB, exact FLX).
    pub fn is_static(&self) -> bool {
        matches!(self.schedule, Schedule::Static { .. })
    }

    /// Whether the plan built before the first epoch is rebuilt during the run: plans change
    /// per iteration (cob, mb) or FLX-EAS draws more than one sample in `epochs`.
    pub fn first_plan_recurs(&self, epochs: usize) -> bool {
        match &self.schedule {
            Schedule::Static { .. } => false,
            Schedule::FlxSampled { every, .. } => every.is_some_and(|n| n > 0 && epochs as u64 > n),
            Schedule::Cob { .. } | Schedule::Mb { .. } | Schedule::Cluster { .. } => true,
        }
    }
}

/// What a run evaluates on (dropout off, every labelled vertex exactly).
pub(crate) enum Eval {
    /// The training plans themselves: FB and exact FLX train on the whole graph.
    TrainingPlans,
    /// Exact whole-partition plans (`[rank][layer]`): FLX-EAS trains on sampled layers over
    /// them and keeps them anyway.
    Plans(Vec<Vec<Arc<DevicePlan>>>),
    /// The whole graph's forward pass layer by layer across the ranks (cob, mb, cluster): each
    /// vertex computed once per layer, in blocks bounded by the rank's memory budget, where a
    /// plan of the whole partition would not fit and exact co-batches recompute their
    /// overlapping closures.
    Layerwise,
}

/// Decides what a run of `popts` (mode already resolved from auto) trains on, for the part of
/// its steps `inputs` names. `sampler` is the options' dependency sampler (None for exact
/// runs); the schedule borrows it.
pub(crate) fn decide<'s>(
    inputs: &StepInputs<'_>,
    config: &ModelConfig,
    popts: &ParallelOptions,
    sampler: Option<&'s dyn Sampler>,
    seed: u64,
) -> anyhow::Result<Decision<'s>> {
    let (ctx, dims) = (inputs.ctx, inputs.dims);
    if let (Mode::Cob | Mode::Mb | Mode::Cluster, Some(k)) = (popts.job.mode, popts.preload_hops())
    {
        bail!(
            "--preload-hops {k}: --mode {} runs every layer on its per-iteration plans; \
             preloading is for --mode flx",
            popts.job.mode.name()
        );
    }
    let batch_size = || -> anyhow::Result<usize> {
        match popts.batch_size() {
            Some(b) if b > 0 => Ok(b),
            Some(_) => bail!("the batch size must be at least 1"),
            // A batched mode's batch size is the job's or its default.
            None => bail!(
                "internal: mode {} reached its schedule without a batch size",
                popts.job.mode.name()
            ),
        }
    };
    let sampler_name = sampler.map_or("exact".into(), |s| s.name());
    let needs_sampler = || sampler.context("a dependency sampler");
    let batching = |reason: String| KChoice {
        k: config.layers,
        estimates: Vec::new(),
        reason,
    };
    match (popts.job.mode, &popts.job.sampling) {
        (Mode::Fb | Mode::Flx, Sampling::None) => {
            let choice = choose_preload_hops(ctx, config, popts)?;
            for e in &choice.estimates {
                tracing::info!(
                    "memory estimate k = {}: worst device (rank {}) {} bytes",
                    e.k,
                    e.worst_rank,
                    e.max_bytes
                );
            }
            tracing::info!("preload hops: {}", choice.reason);
            let plan: PreloadPlan = ctx.preload_plan(choice.k, config.layers)?;
            if !plan.reshape_is_identity_prefix() {
                bail!("internal: the FLX plan's inner rows are not the FB plan's owned prefix");
            }
            let replicated_vertices = plan
                .flx
                .as_ref()
                .map_or(0, |f| f.servers.iter().map(|s| s.replicated).sum());
            let predicted = predicted_halo_bytes(&plan, config);
            let (step, stats) = steps::static_step(inputs, plan.fb.devices, plan.flx, choice.k);
            Ok(Decision {
                schedule: Schedule::Static { step, stats },
                choice,
                predicted,
                replicated_vertices,
                eval: Eval::TrainingPlans,
                sampling: sampler_name,
            })
        }
        (Mode::Fb, _) | (Mode::Flx | Mode::Mb, Sampling::Saint { .. }) => bail!(
            "{}",
            popts
                .job
                .sampling
                .conflict_with(popts.job.mode)
                .unwrap_or_else(|| "internal: no conflict for this mode and sampling".into())
        ),
        (Mode::Flx, _) => {
            let sampler = needs_sampler()?;
            let fb = ctx.fb_plan()?;
            let choice = match popts.preload_hops() {
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
                None => choose_sampled_k(ctx, dims, &fb, sampler, popts)?,
            };
            tracing::info!("preload hops: {}", choice.reason);
            let fb: Vec<Arc<DevicePlan>> = fb.devices.into_iter().map(Arc::new).collect();
            let eval_plans = fb.iter().map(|d| vec![d.clone(); config.layers]).collect();
            Ok(Decision {
                schedule: Schedule::FlxSampled {
                    k: choice.k,
                    fb,
                    sampler,
                    every: popts.job.resample_every,
                },
                choice,
                predicted: LinkBytes::default(),
                replicated_vertices: 0,
                eval: Eval::Plans(eval_plans),
                sampling: sampler_name,
            })
        }
        (Mode::Cob, s) => {
            let b = batch_size()?;
            // A link job's co-batches are supervision edges, each on its source's server.
            let (batcher, what) = match inputs.link {
                Some(seeds) => (
                    CoBatcher::for_edges(ctx, &seeds.sources(), b, seed)?,
                    " supervision edges",
                ),
                None => (CoBatcher::new(ctx, b, seed)?, ""),
            };
            let (sampler, sampling) = match s {
                Sampling::Saint { .. } => {
                    let saint = grandis_sampling::saint_sampler(&popts.job.sampling, b, seed)
                        .context("saint sampler")?;
                    let name = format!("saint({:?})", saint.kind);
                    (CobSampler::Saint(saint), name)
                }
                _ => (CobSampler::Deps(needs_sampler()?), sampler_name),
            };
            let choice = batching(format!(
                "cooperative batching: co-batches of at most {b}{what} per server, {} iterations \
                 per epoch, every layer masked",
                batcher.iterations()
            ));
            Ok(Decision {
                schedule: Schedule::Cob { batcher, sampler },
                choice,
                predicted: LinkBytes::default(),
                replicated_vertices: 0,
                eval: Eval::Layerwise,
                sampling,
            })
        }
        (Mode::Mb, _) => {
            let b = batch_size()?;
            let (batcher, what) = match inputs.link {
                // A link job's batches are supervision edges, each on its source's rank.
                Some(seeds) => (
                    MiniBatcher::for_edges(ctx, &seeds.sources(), b, seed)?,
                    " supervision edges",
                ),
                None => (MiniBatcher::new(ctx, b, seed)?, ""),
            };
            let choice = batching(format!(
                "per-GPU mini-batches of at most {b}{what} per device, {} iterations per epoch",
                batcher.iterations()
            ));
            Ok(Decision {
                schedule: Schedule::Mb {
                    batcher,
                    sampler: needs_sampler()?,
                },
                choice,
                predicted: LinkBytes::default(),
                replicated_vertices: 0,
                eval: Eval::Layerwise,
                sampling: sampler_name,
            })
        }
        (Mode::Cluster, Sampling::None) => {
            let b = batch_size()?;
            let size = (b / CLUSTERS_PER_BATCH).max(1) as u64;
            let layout = ctx.layout();
            let server_of: Vec<u32> = (0..layout.num_vertices())
                .map(|v| layout.server_of(v) as u32)
                .collect();
            let cluster_of = grandis_partition::fine_clusters(
                ctx.graph(),
                ctx.is_symmetric(),
                &server_of,
                layout.servers(),
                size,
                seed,
            )
            .context("cutting the servers' vertices into clusters")?;
            let batches = ClusterBatches::new(ctx, &cluster_of, CLUSTERS_PER_BATCH, seed)?;
            let choice = batching(format!(
                "cluster batches: {CLUSTERS_PER_BATCH} METIS clusters of about {size} vertices \
                 per server per iteration ({:?} clusters per server), {} iterations per epoch, \
                 neighbours restricted to the batch",
                batches.clusters(),
                batches.iterations()
            ));
            Ok(Decision {
                sampling: batches.name(),
                schedule: Schedule::Cluster { batches },
                choice,
                predicted: LinkBytes::default(),
                replicated_vertices: 0,
                // Evaluation is exact, as in every mode: full neighbourhoods.
                eval: Eval::Layerwise,
            })
        }
        (Mode::Cluster, s) => bail!(
            "{}",
            s.conflict_with(Mode::Cluster)
                .unwrap_or_else(|| "internal: no conflict for this mode and sampling".into())
        ),
        (Mode::Single | Mode::Auto, _) => {
            bail!(
                "internal: mode {} reached the planner unresolved",
                popts.job.mode
            )
        }
    }
}
