//! `mode = auto` (GraNNDIS §8.6), decided where the run starts: FLX with the largest k that
//! fits when plain FB fits the per-device budget (the full graph fits the servers' aggregate
//! memory), otherwise CoB with the largest co-batch that fits, with the sampler the run will
//! use. Every server of a cluster job decides from the same job, dataset and partition, so
//! all reach the same decision.

use anyhow::{bail, Context};
use grandis_models::ModelConfig;
use grandis_sampling::{AutoChoice, AutoDecision};
use grandis_store::DatasetView;
use grandis_wire::{Mode, Sampling};

use crate::{ParallelOptions, PartitionedGraph};

/// The options to run with: `popts` itself for fb, flx, cob and mb; for auto, the decision's
/// options and the decision. Single is the single-process trainer's mode, not a parallel one.
pub(crate) fn resolve_mode(
    view: &DatasetView<'_>,
    part: &PartitionedGraph,
    config: &ModelConfig,
    popts: &ParallelOptions,
    seed: u64,
) -> anyhow::Result<(ParallelOptions, Option<AutoDecision>)> {
    match popts.mode {
        Mode::Fb | Mode::Flx | Mode::Cob | Mode::Mb => Ok((popts.clone(), None)),
        Mode::Auto => {
            let (p, d) = decide_auto(view, part, config, popts, seed)?;
            Ok((p, Some(d)))
        }
        Mode::Single => bail!(
            "mode single is the single-process trainer (`grandis train --mode single`); the \
             partition-parallel modes are fb, flx, cob, mb and auto"
        ),
    }
}

/// The `auto` decision for `popts` (its sampler, budget and co-batch size, if any) and the
/// options it leads to.
pub fn decide_auto(
    view: &DatasetView<'_>,
    part: &PartitionedGraph,
    config: &ModelConfig,
    popts: &ParallelOptions,
    seed: u64,
) -> anyhow::Result<(ParallelOptions, AutoDecision)> {
    let ctx = crate::plan_context(view, part)?;
    let dims = crate::model_dims(config);
    let (budget, _) = crate::budget::budget(popts, &part.layout)?;
    let sampler = grandis_sampling::dependency_sampler(&popts.sampling, config.layers, seed)?
        .unwrap_or_else(|| Box::new(grandis_sampling::Exact));
    let decision = grandis_sampling::auto_mode(&ctx, &dims, budget, sampler.as_ref(), seed)
        .context("mode auto")?;
    tracing::info!("{decision}");
    let resolved = match decision.mode {
        AutoChoice::Flx { k } => ParallelOptions {
            mode: if k == 0 { Mode::Fb } else { Mode::Flx },
            preload_hops: (k > 0).then_some(k),
            // FLX trains on the exact graph or with EAS; other samplers are co-batch ones.
            sampling: match popts.sampling {
                Sampling::Eas { .. } if k > 0 => popts.sampling.clone(),
                _ => Sampling::None,
            },
            batch_size: None,
            ..popts.clone()
        },
        AutoChoice::Cob { batch_size } => ParallelOptions {
            mode: Mode::Cob,
            preload_hops: None,
            batch_size: Some(batch_size),
            ..popts.clone()
        },
    };
    Ok((resolved, decision))
}
