//! A run from start to end: the checks of its inputs, the planner's mode (`auto`), the
//! decision of what it trains on (`decide`), the run of its ranks (`run`) and its report;
//! or, from a checkpoint that holds every epoch, the prediction alone.

use anyhow::{bail, Context};
use grandis_engine::Backend;
use grandis_fabric::Endpoint;
use grandis_models::{Model, ModelConfig};
use grandis_store::DatasetView;
use grandis_trainer::{EpochStats, Objective, TrainOptions};
use grandis_wire::Mode;

use crate::budget::job_dims;
use crate::embedding_shard::EmbeddingShard;
use crate::infer::{infer_rank, InferShared, RankInference};
use crate::input::PartitionedGraph;
use crate::link_task::{LinkSeeds, LinkTask};
use crate::options::ParallelOptions;
use crate::report::ParallelReport;
use crate::setup::{check_job_inputs, dependency_sampler, in_train_split, labelled, plan_context};
use crate::steps::{StepInputs, StepPart};
use crate::{auto, decide, run};

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
    let links = check_job_inputs(&view, part, &config, opts.objective, opts.embedding_dim)?;
    // The run trains `opts.objective`; the planner reads the task off the job, which a
    // library caller may have left at its default.
    let mut popts = popts.clone();
    popts.job.task = opts.objective.task();
    let (popts, plan) = auto::resolve_mode(
        &view,
        part,
        &config,
        &popts,
        opts.seed,
        local.as_deref_mut(),
    )?;
    // The job's combinations (staleness only for fb / flx, remote features only for the
    // mini-batch modes, ...) were checked once where it entered (`JobSpec::validate`); auto
    // resolves to a mode its spec allows.
    let link = match (opts.objective, links) {
        (Objective::Link { negatives, .. }, Some(split)) => {
            // A job spec never gets here otherwise (`JobSpec::validate`); a library caller
            // must not get another task in its place.
            if let Some(why) = grandis_wire::task_conflict(
                grandis_wire::Task::Link,
                popts.job.mode,
                &popts.job.sampling,
            ) {
                bail!(why);
            }
            Some(LinkTask { split, negatives })
        }
        _ => None,
    };
    let resume = popts.machine.checkpoint.resume_from(&config, opts)?;
    if let Some(ck) = &resume {
        if ck.epochs_done == opts.epochs && popts.infer().is_some() {
            tracing::info!(
                "the checkpoint holds all {} epochs: predicting without training",
                ck.epochs_done
            );
            return predict_only(view, part, &config, ck, &popts, local);
        }
        ck.check_epochs_left(opts.epochs)?;
    }
    let (labelled_flags, totals) = labelled(&view, part)?;
    if totals[0] == 0 && link.is_none() {
        bail!("the dataset's train split has no labelled vertices");
    }
    let ctx = plan_context(&view, part)?;
    let dims = job_dims(&config, &popts.job, view.num_vertices());
    // The sampler outlives the schedule that borrows it.
    let sampler = dependency_sampler(&view, part, &popts.job.sampling, config.layers, opts.seed)?;
    // Under a daemon (one server's ranks here) each step's part of the other servers is
    // built by theirs.
    let part_here = match local.as_deref() {
        Some([first, ..]) => StepPart::Server(first.server()),
        _ => StepPart::All,
    };
    let labelled_train = |g: u32| in_train_split(&labelled_flags, g);
    // A link job's batches (mb, cob) are seeded by its supervision edges; a cluster batch
    // scores the edges inside it.
    let link_seeds = match (&link, popts.job.mode) {
        (Some(task), mode @ (Mode::Mb | Mode::Cob | Mode::Cluster)) => Some(LinkSeeds::new(
            *task,
            part,
            opts.seed,
            mode == Mode::Cluster,
        )),
        _ => None,
    };
    let step_inputs = StepInputs {
        ctx: &ctx,
        dims: &dims,
        step_part: part_here,
        labelled_train: &labelled_train,
        link: link_seeds.as_ref(),
    };
    let decision = decide::decide(&step_inputs, &config, &popts, sampler.as_deref(), opts.seed)?;
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
        step_part: part_here,
        resume: resume.as_ref(),
        link,
        link_seeds: link_seeds.as_ref(),
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

/// Predicts with a checkpoint that holds every epoch the run asks for, without training (a
/// retry after a failure in the inference, `train --resume` on a finished checkpoint): the
/// ranks load the model and run [`infer_rank`]. `local`: only one server's ranks, as in
/// training.
fn predict_only(
    view: DatasetView<'_>,
    part: &crate::PartitionedGraph,
    config: &grandis_models::ModelConfig,
    ck: &grandis_trainer::Checkpoint,
    popts: &crate::ParallelOptions,
    local: Option<Vec<Endpoint>>,
) -> anyhow::Result<crate::ParallelReport> {
    use crate::Compute;
    let layout = &part.layout;
    let local_ranks = local.as_ref().map_or(layout.num_ranks(), Vec::len);
    let threads_per_rank = popts.rank_threads(local_ranks);
    let scales = grandis_engine::norm::global_scales(
        part.graph.view(),
        grandis_models::aggregation(config.kind),
    );
    let shared = InferShared::new(popts, part, view, &scales, local_ranks)?
        .context("predicting without training needs inference options")?;
    fn on<B: Backend>(
        b: &B,
        config: &grandis_models::ModelConfig,
        ck: &grandis_trainer::Checkpoint,
        mut ep: Endpoint,
        shared: &InferShared<'_>,
    ) -> anyhow::Result<(RankInference, grandis_fabric::Counters)> {
        let mut model = Model::new(b, config.clone())?;
        ck.restore(b, &mut model, false)?;
        // The checkpoint's learnable embeddings, this rank's rows of them.
        let part = shared.pass.part;
        let embeddings = match ck.node_embeddings(part.new_to_old.len(), false)? {
            Some(table) => Some(EmbeddingShard::new(
                &part.layout,
                ep.rank(),
                &part.new_to_old,
                (table.dim(), config.seed),
                Some(&table),
                false,
            )?),
            None => None,
        };
        let r = infer_rank(b, &model, &mut ep, shared, embeddings.as_ref())?;
        Ok((r, ep.counters()))
    }
    let work = |ep: Endpoint| match &popts.machine.compute {
        Compute::Cpu => {
            let b = grandis_engine::CpuBackend::new(Some(threads_per_rank))?;
            on(&b, config, ck, ep, &shared)
        }
        Compute::Cuda { .. } => {
            let b = crate::compute::cuda_rank_backend(&popts.machine.compute, &ep)?;
            on(&b, config, ck, ep, &shared)
        }
    };
    let endpoints = match local {
        Some(endpoints) => endpoints,
        None => popts.in_process_endpoints(layout)?,
    };
    let results = grandis_fabric::run_ranks(endpoints, work)?;
    let num_parameters =
        Model::new(&grandis_engine::CpuBackend::new(Some(1))?, config.clone())?.num_parameters();
    Ok(crate::ParallelReport::predicted_only(
        popts,
        part,
        threads_per_rank,
        num_parameters,
        ck.epochs_done,
        results,
    ))
}
