//! The host side of batched steps, stage by stage, as a run builds them (`grandis bench
//! steps`): sampling (`steps::sample_step`), plan building with the step's statistics
//! (`steps::plan_step`) and the gather of every rank's layer-0 feature rows (what a
//! rank reads before its upload), either one step at a time with every thread on it
//! ([`time_steps`]) or as a run's producers build them, one thread per step
//! ([`time_producers`]). Timing is the caller's: it runs them inside a rayon pool of the
//! thread count it measures, since every stage parallelises on the current pool.

use std::time::Instant;

use anyhow::{bail, Context};
use grandis_masking::{ModelDims, PlanContext};
use grandis_models::ModelConfig;
use grandis_store::DatasetView;
use grandis_wire::{Mode, Sampling};
use rayon::prelude::*;

use crate::steps::{plan_step, sample_step, CobSampler, Schedule, StepInputs, StepPart};
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

/// What every step of a bench needs: the planning context, the schedule and the labels.
struct Bench<'v> {
    view: &'v DatasetView<'v>,
    part: &'v PartitionedGraph,
    ctx: PlanContext<'v>,
    flags: Vec<u8>,
    dims: ModelDims,
    layers: usize,
}

impl<'v> Bench<'v> {
    fn new(
        view: &'v DatasetView<'v>,
        part: &'v PartitionedGraph,
        config: &ModelConfig,
        opts: &StepBenchOptions,
    ) -> anyhow::Result<Bench<'v>> {
        crate::setup::check_inputs(view, part, config)?;
        // The allocator as a run has it (its CPU backend sets this): freed step buffers kept
        // for the next step, not returned to the kernel and faulted in again.
        grandis_engine::cpu::retain_freed_memory();
        if opts.fanouts.len() != config.layers {
            bail!(
                "{} fanouts for a {}-layer model: give one per layer",
                opts.fanouts.len(),
                config.layers
            );
        }
        let ctx = crate::setup::plan_context(view, part)?;
        let (flags, _) = crate::setup::labelled(view, part)?;
        Ok(Bench {
            view,
            part,
            ctx,
            flags,
            dims: crate::budget::model_dims(config),
            layers: config.layers,
        })
    }

    /// Runs `f` with the schedule of `opts`.
    fn with_schedule<R>(
        &self,
        opts: &StepBenchOptions,
        f: impl FnOnce(&Schedule<'_>) -> anyhow::Result<R>,
    ) -> anyhow::Result<R> {
        let sampling = Sampling::Fanout {
            fanouts: opts.fanouts.clone(),
            relation_fanouts: Default::default(),
        };
        let sampler =
            grandis_sampling::dependency_sampler(&sampling, self.layers, opts.seed, None)?
                .context("internal: fanout sampling has a dependency sampler")?;
        let schedule = match opts.mode {
            Mode::Mb => Schedule::Mb {
                batcher: grandis_sampling::MiniBatcher::new(&self.ctx, opts.batch_size, opts.seed)?,
                sampler: sampler.as_ref(),
            },
            Mode::Cob => Schedule::Cob {
                batcher: grandis_sampling::CoBatcher::new(&self.ctx, opts.batch_size, opts.seed)?,
                sampler: CobSampler::Deps(sampler.as_ref()),
            },
            other => bail!("bench steps builds mb or cob steps, not {other:?}"),
        };
        if schedule.iterations() == 0 {
            bail!("the dataset has no labelled training vertex to batch");
        }
        f(&schedule)
    }

    /// Samples and plans step `it` of epoch 0: the step, its seconds in each stage, and its
    /// sampled edges.
    fn build(
        &self,
        schedule: &Schedule<'_>,
        it: usize,
    ) -> anyhow::Result<(std::sync::Arc<crate::steps::Step>, f64, f64, u64)> {
        let labelled_train = |g: u32| crate::setup::in_train_split(&self.flags, g);
        let inputs = StepInputs {
            ctx: &self.ctx,
            dims: &self.dims,
            step_part: StepPart::All,
            labelled_train: &labelled_train,
            link: None,
        };
        let t = Instant::now();
        let sampled = sample_step(&inputs, schedule, 0, it)?;
        let sampled_edges = sampled.sampled_edges();
        let sample_s = t.elapsed().as_secs_f64();
        let t = Instant::now();
        let (_, step, _stats) = plan_step(&inputs, sampled)?;
        Ok((step, sample_s, t.elapsed().as_secs_f64(), sampled_edges))
    }

    /// Gathers every rank's layer-0 feature rows of `step` into `rows`; the rows read.
    fn gather(&self, step: &crate::steps::Step, rows: &mut Vec<f32>) -> anyhow::Result<u64> {
        let f = self.view.feature_dim;
        let mut input_rows = 0u64;
        for per_layer in &step.plans {
            let p = per_layer
                .first()
                .context("internal: a rank without plans")?;
            let ids: Vec<u32> = p.global_ids[..p.n_owned]
                .iter()
                .map(|&g| self.part.new_to_old[g as usize])
                .collect();
            rows.resize(ids.len() * f, 0.0);
            self.view
                .gather_features(&ids, rows)
                .context("gathering the step's feature rows")?;
            input_rows += ids.len() as u64;
        }
        Ok(input_rows)
    }
}

/// Builds the first `opts.steps` steps of epoch 0 of `opts.mode` with layer-wise fanout
/// sampling on the current rayon pool, one after the other, timing each stage of each step.
pub fn time_steps(
    view: &DatasetView<'_>,
    part: &PartitionedGraph,
    config: &ModelConfig,
    opts: &StepBenchOptions,
) -> anyhow::Result<Vec<StepTiming>> {
    let bench = Bench::new(view, part, config, opts)?;
    bench.with_schedule(opts, |schedule| {
        let mut rows: Vec<f32> = Vec::new();
        let mut out = Vec::with_capacity(opts.steps);
        for it in 0..opts.steps.min(schedule.iterations()) {
            let (step, sample_s, plan_s, sampled_edges) = bench.build(schedule, it)?;
            let t = Instant::now();
            let input_rows = bench.gather(&step, &mut rows)?;
            out.push(StepTiming {
                sample_s,
                plan_s,
                gather_s: t.elapsed().as_secs_f64(),
                sampled_edges,
                input_rows,
            });
        }
        Ok(out)
    })
}

/// The same steps built as a run's producers build them: `producers` threads of the current
/// rayon pool, each taking every `producers`-th step whole on its own share of the pool's
/// threads (`feed::producer_pool`) and dropping each step once built, as a run's ranks drop a
/// trained step; then, in a second phase, the gathers of the same steps. What a run's ranks
/// can be fed per second.
#[derive(Debug, Clone, Default, serde::Serialize)]
pub struct ProducerTiming {
    pub producers: usize,
    /// Kept in-edges of every step, in step order (one entry per step built).
    pub sampled_edges: Vec<u64>,
    /// Layer-0 feature rows of every step, in step order.
    pub input_rows: Vec<u64>,
    /// Wall seconds until every step was sampled and planned.
    pub sample_plan_s: f64,
    /// Wall seconds until every step's rows were gathered.
    pub gather_s: f64,
}

/// See [`ProducerTiming`].
pub fn time_producers(
    view: &DatasetView<'_>,
    part: &PartitionedGraph,
    config: &ModelConfig,
    opts: &StepBenchOptions,
    producers: usize,
) -> anyhow::Result<ProducerTiming> {
    let producers = producers.max(1);
    let bench = Bench::new(view, part, config, opts)?;
    bench.with_schedule(opts, |schedule| {
        let n = opts.steps.min(schedule.iterations());
        // Each producer's steps, `producers` apart, as a run deals them out.
        let mine = |p: usize| (p..n).step_by(producers);
        // Each producer on the pool a run's producer has (its share of the cores).
        let cores = rayon::current_num_threads();
        let pools = (0..producers)
            .map(|p| crate::feed::producer_pool(producers, cores, p))
            .collect::<anyhow::Result<Vec<_>>>()?;
        let on_its_pool = |p: usize, f: &(dyn Fn() -> anyhow::Result<Vec<(usize, u64)>> + Sync)| {
            match &pools[p] {
                Some(pool) => pool.install(f),
                None => f(),
            }
        };
        // Sampling and plans: each step is dropped once built, as a run's ranks drop a step
        // once trained, so the producers reuse the memory of their earlier steps.
        let t = Instant::now();
        let edges: Vec<(usize, u64)> = (0..producers)
            .into_par_iter()
            .map(|p| {
                on_its_pool(p, &|| {
                    mine(p)
                        .map(|it| bench.build(schedule, it).map(|b| (it, b.3)))
                        .collect::<anyhow::Result<Vec<_>>>()
                })
            })
            .collect::<anyhow::Result<Vec<_>>>()?
            .into_iter()
            .flatten()
            .collect();
        let sample_plan_s = t.elapsed().as_secs_f64();
        // Gathers: the same steps built again (not timed), then every producer's rows read.
        let steps = (0..producers)
            .into_par_iter()
            .map(|p| {
                mine(p)
                    .map(|it| bench.build(schedule, it).map(|b| (it, b.0)))
                    .collect::<anyhow::Result<Vec<_>>>()
            })
            .collect::<anyhow::Result<Vec<_>>>()?;
        // Each producer's rows buffer sized for its largest step before the clock starts, as a
        // run's buffer pool keeps them from step to step: the first touch of a fresh buffer's
        // pages (about 10 us a page on this VM) is not a step's work.
        let buffers: Vec<std::sync::Mutex<Vec<f32>>> = steps
            .iter()
            .map(|mine| {
                let most = mine
                    .iter()
                    .flat_map(|(_, s)| s.plans.iter().filter_map(|p| p.first()))
                    .map(|p| p.n_owned)
                    .max()
                    .unwrap_or(0);
                let mut rows = Vec::new();
                rows.resize(most * bench.view.feature_dim, 0.0);
                std::sync::Mutex::new(rows)
            })
            .collect();
        let t = Instant::now();
        let rows_read = steps
            .par_iter()
            .enumerate()
            .map(|(p, mine)| {
                on_its_pool(p, &|| {
                    let mut rows = buffers[p].lock().unwrap_or_else(|e| e.into_inner());
                    mine.iter()
                        .map(|(it, s)| Ok((*it, bench.gather(s, &mut rows)?)))
                        .collect()
                })
            })
            .collect::<anyhow::Result<Vec<_>>>()?;
        let gather_s = t.elapsed().as_secs_f64();
        let in_order = |mut v: Vec<(usize, u64)>| -> Vec<u64> {
            v.sort_unstable();
            v.into_iter().map(|x| x.1).collect()
        };
        Ok(ProducerTiming {
            producers,
            sampled_edges: in_order(edges),
            input_rows: in_order(rows_read.into_iter().flatten().collect()),
            sample_plan_s,
            gather_s,
        })
    })
}
