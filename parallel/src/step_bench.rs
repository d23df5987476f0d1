//! The host side of batched steps, stage by stage, as a run builds them (`grandis bench
//! steps`): sampling (`steps::sample_step`), plan building with the step's statistics
//! (`steps::plan_step`) and the gather of every rank's layer-0 feature rows (what a
//! rank reads before its upload). Timing is the caller's: it runs [`time_steps`] inside a rayon
//! pool of the thread count it measures, since every stage parallelises on the current pool.

use std::time::Instant;

use anyhow::{bail, Context};
use grandis_models::ModelConfig;
use grandis_store::DatasetView;
use grandis_wire::{Mode, Sampling};

use crate::steps::{plan_step, sample_step, CobSampler, Schedule};
use crate::PartitionedGraph;

/// Which steps to build.
#[derive(Debug, Clone)]
pub struct StepBenchOptions {
    /// `Mode::Mb` (a mini-batch per rank) or `Mode::Cob` (a co-batch per server).
    pub mode: Mode,
    pub batch_size: usize,
    /// Per hop from the targets (hop 1 first), one per layer.
    pub fanouts: Vec<u32>,
    /// Steps to build, the first iterations of epoch 0 (at most the epoch's iterations).
    pub steps: usize,
    pub seed: u64,
}

/// One step's host work.
#[derive(Debug, Clone, Default, serde::Serialize)]
pub struct StepTiming {
    /// Seconds drawing the step's sampled dependencies.
    pub sample_s: f64,
    /// Seconds building its plans and counting what they compute.
    pub plan_s: f64,
    /// Seconds gathering every rank's layer-0 feature rows.
    pub gather_s: f64,
    /// Kept in-edges over the step's samples.
    pub sampled_edges: u64,
    /// Layer-0 feature rows the ranks read (DGL's `input_nodes`, summed over ranks).
    pub input_rows: u64,
}

/// Builds the first `opts.steps` steps of epoch 0 of `opts.mode` with layer-wise fanout
/// sampling on the current rayon pool, timing each stage of each step.
pub fn time_steps(
    view: &DatasetView<'_>,
    part: &PartitionedGraph,
    config: &ModelConfig,
    opts: &StepBenchOptions,
) -> anyhow::Result<Vec<StepTiming>> {
    crate::setup::check_inputs(view, part, config)?;
    if opts.fanouts.len() != config.layers {
        bail!(
            "{} fanouts for a {}-layer model: give one per layer",
            opts.fanouts.len(),
            config.layers
        );
    }
    let ctx = crate::setup::plan_context(view, part)?;
    let (flags, _) = crate::setup::labelled(view, part)?;
    let labelled_train = |g: u32| crate::setup::in_train_split(&flags, g);
    let sampling = Sampling::Fanout {
        fanouts: opts.fanouts.clone(),
    };
    let sampler = grandis_sampling::dependency_sampler(&sampling, config.layers, opts.seed)?
        .context("internal: fanout sampling has a dependency sampler")?;
    let schedule = match opts.mode {
        Mode::Mb => Schedule::Mb {
            batcher: grandis_sampling::MiniBatcher::new(&ctx, opts.batch_size, opts.seed)?,
            sampler: sampler.as_ref(),
        },
        Mode::Cob => Schedule::Cob {
            batcher: grandis_sampling::CoBatcher::new(&ctx, opts.batch_size, opts.seed)?,
            sampler: CobSampler::Deps(sampler.as_ref()),
        },
        other => bail!("bench steps builds mb or cob steps, not {other:?}"),
    };
    let iterations = schedule.iterations();
    if iterations == 0 {
        bail!("the dataset has no labelled training vertex to batch");
    }
    let dims = crate::budget::model_dims(config);
    let f = view.feature_dim;
    let mut rows: Vec<f32> = Vec::new();
    let mut out = Vec::with_capacity(opts.steps);
    for it in 0..opts.steps.min(iterations) {
        let t = Instant::now();
        let sampled = sample_step(&ctx, &schedule, config.layers, 0, it)?;
        let sampled_edges = sampled.sampled_edges();
        let sample_s = t.elapsed().as_secs_f64();
        let t = Instant::now();
        let (_, step, _stats) = plan_step(&ctx, sampled, &dims, &labelled_train)?;
        let plan_s = t.elapsed().as_secs_f64();
        let t = Instant::now();
        let mut input_rows = 0u64;
        for per_layer in &step.plans {
            let p = per_layer
                .first()
                .context("internal: a rank without plans")?;
            let ids: Vec<u32> = p.global_ids[..p.n_owned]
                .iter()
                .map(|&g| part.new_to_old[g as usize])
                .collect();
            rows.resize(ids.len() * f, 0.0);
            view.gather_features(&ids, &mut rows)
                .context("gathering the step's feature rows")?;
            input_rows += ids.len() as u64;
        }
        out.push(StepTiming {
            sample_s,
            plan_s,
            gather_s: t.elapsed().as_secs_f64(),
            sampled_edges,
            input_rows,
        });
    }
    Ok(out)
}
