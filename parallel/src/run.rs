//! Running a decided run: the context every rank shares, the step feed, the plan producer
//! thread (per-step schedules), and one worker per rank on its backend, over the in-process
//! fabric or over the endpoints of one server (`grandis_fabric::run_ranks` either way).

use std::sync::Mutex;

use anyhow::{bail, Context};
use grandis_engine::norm::global_scales;
use grandis_engine::CpuBackend;
use grandis_fabric::Endpoint;
use grandis_masking::{ModelDims, PlanContext};
use grandis_models::ModelConfig;
use grandis_store::DatasetView;
use grandis_trainer::{Checkpoint, EpochStats, TrainOptions};

use crate::compute::{cuda_rank_backend, rank_ordinals, Compute};
use crate::decide::{Decision, Eval};
use crate::feed::{BuildSeconds, StepCounts};
use crate::fetch::{Answerer, Prefetcher};
use crate::links::copies::CopyHub;
use crate::links::nccl::{HostNccl, Nccl};
use crate::links::{IntraTransport, Transports};
use crate::prepare::HostInput;
use crate::setup::in_train_split;
use crate::steps::{RunStats, Schedule, StepInputs, StepPart};
use crate::worker::{self, RankResult};
use crate::{metered, ParallelOptions, PartitionedGraph};

/// Steps the plan producers may build ahead of the slowest rank beyond one per producer.
const PREFETCH_STEPS: usize = 2;

/// Producer threads building per-step plans when the options name none. CPU ranks: half the
/// cores (the ranks' compute has the rest while it is the bottleneck; producers that run
/// ahead block on the feed's window), at most 8. CUDA ranks compute on their devices and
/// their threads mostly wait on them: every core but one per rank run here, at most 32 (on
/// the H100 eight producers left mini-batch steps host-bound ~20x).
fn default_plan_threads(compute: &Compute, ranks_here: usize) -> usize {
    let cores = std::thread::available_parallelism().map_or(1, |c| c.get());
    if compute.is_cuda() {
        cores.saturating_sub(ranks_here).clamp(1, 32)
    } else {
        (cores / 2).clamp(1, 8)
    }
}

/// What a decided run needs besides its planning context.
pub(crate) struct RunInputs<'a, 's> {
    pub view: DatasetView<'a>,
    pub part: &'a PartitionedGraph,
    pub config: &'a ModelConfig,
    pub opts: &'a TrainOptions,
    /// The resolved options (no auto).
    pub popts: &'a ParallelOptions,
    /// `SPLIT_*` flags by new id and the labelled train / val / test totals (`setup::labelled`).
    pub labelled_flags: &'a [u8],
    pub totals: [usize; 3],
    pub dims: &'a ModelDims,
    pub decision: &'a Decision<'s>,
    /// The part of every step this process builds.
    pub step_part: StepPart,
    /// The checkpoint the ranks start from (weights, Adam moments, epochs done).
    pub resume: Option<&'a Checkpoint>,
    /// Link prediction's task, when the run trains for it.
    pub link: Option<crate::link_task::LinkTask<'a>>,
    /// A link job's supervision edges, where they seed its batches (modes mb, cob) or are
    /// scored inside them (cluster).
    pub link_seeds: Option<&'a crate::link_task::LinkSeeds<'a>>,
}

/// What the ranks run here handed back.
pub(crate) struct Ran {
    /// One result per rank run here, in rank order.
    pub results: Vec<RankResult>,
    /// What the steps computed: the producers' counts, every server's.
    pub stats: RunStats,
    pub threads_per_rank: usize,
    pub transports: Transports,
}

/// Trains the ranks: all of them on an in-process fabric, or — with `local` — only the given
/// endpoints (one server's ranks over a real transport). `ctx` is dropped before training when
/// one plan serves the whole run (it holds the transposed graph).
pub(crate) fn run(
    inputs: RunInputs<'_, '_>,
    ctx: PlanContext<'_>,
    on_epoch: &mut (dyn FnMut(&EpochStats) + Send),
    local: Option<Vec<Endpoint>>,
) -> anyhow::Result<Ran> {
    let RunInputs {
        view,
        part,
        config,
        opts,
        popts,
        labelled_flags,
        totals,
        dims,
        decision,
        step_part: part_here,
        resume,
        link,
        link_seeds,
    } = inputs;
    // The host side of the memory model, before the ranks allocate anything.
    let relied_on = crate::budget::page_cache_relied_on(part);
    let available = grandis_telemetry::mem_available_bytes();
    let ranks_here: Vec<usize> = match &local {
        Some(endpoints) => endpoints.iter().map(Endpoint::rank).collect(),
        None => (0..part.layout.num_ranks()).collect(),
    };
    let embeddings = crate::embedding_shard::host_bytes(
        &part.layout,
        ranks_here.iter().copied(),
        opts.embedding_dim,
    );
    crate::budget::check_host_memory(relied_on, embeddings, available)?;
    if relied_on > 0 {
        tracing::info!(
            "host memory: the run relies on {relied_on} bytes of page cache (the mapped graph); \
             {} bytes available",
            available.map_or("unknown".into(), |a| a.to_string())
        );
    }
    let epochs = opts.epochs.max(1);
    let epochs_done = resume.map_or(0, |ck| ck.epochs_done);
    let layout = &part.layout;
    let local_ranks = ranks_here.len();
    let threads_per_rank = popts.rank_threads(local_ranks);
    let scales = global_scales(part.graph.view(), grandis_models::aggregation(config.kind));
    // Every step is kept until each rank run HERE took it.
    let iterations = decision.schedule.iterations();
    let plan_threads = popts
        .machine
        .plan_threads
        .unwrap_or_else(|| default_plan_threads(&popts.machine.compute, local_ranks));
    let feed = crate::feed::Feed::new(
        local_ranks,
        if decision.is_static() {
            epochs
        } else {
            plan_threads + PREFETCH_STEPS
        },
        (epochs_done * iterations) as u64,
    );
    let counts = StepCounts::default();
    let eval_inputs = match decision.eval {
        Eval::Layerwise => Some(crate::infer::PassInputs::new(
            popts,
            part,
            view,
            &scales,
            local_ranks,
            None,
        )?),
        _ => None,
    };
    let eval = match (&decision.eval, &eval_inputs) {
        (Eval::TrainingPlans, _) => crate::shared::EvalOn::TrainingPlans,
        (Eval::Plans(plans), _) => crate::shared::EvalOn::Plans(plans),
        (Eval::Layerwise, Some(inputs)) => crate::shared::EvalOn::Layerwise(inputs),
        (Eval::Layerwise, None) => bail!("internal: layer-wise evaluation without its inputs"),
    };
    // Per-step plans: each rank's next step's feature rows are read ahead.
    let prefetcher = Prefetcher::new();
    let answerer = Answerer::new();
    let infer = crate::infer::InferShared::new(popts, part, view, &scales, local_ranks)?;
    let buffers = feature_buffers(&popts.machine.compute, layout.devices());
    let shared = crate::shared::Shared {
        view,
        new_to_old: &part.new_to_old,
        layout,
        scales: &scales,
        config,
        opts,
        link,
        labelled_flags,
        totals,
        collect_logits: popts.machine.collect_logits,
        infer,
        feed: &feed,
        prefetch: (!decision.is_static()).then_some(&prefetcher),
        answerer: (!decision.is_static()).then_some(&answerer),
        iterations,
        eval,
        weights: None,
        resume,
        checkpoint: &popts.machine.checkpoint,
        staleness: popts.job.staleness,
        remote_features: popts.job.remote_features,
        buffers: &buffers,
        server_counts: (matches!(part_here, StepPart::Server(_)) && layout.servers() > 1)
            .then_some(&counts),
        steps_read_every_vertex: decision.is_static(),
    };
    let callback: worker::EpochCallback<'_> = Mutex::new(on_epoch);
    let transports = crate::links::select(
        &popts.machine.compute,
        &rank_ordinals(&popts.machine.compute, layout.devices())?,
        popts.job.inter_transport,
        popts.machine.intra_transport,
    )?;
    let hub = (transports.intra == IntraTransport::DeviceCopies).then(|| {
        let topology = grandis_fabric::Topology {
            servers: layout.servers(),
            devices: layout.devices(),
        };
        CopyHub::new(topology, &ranks_here)
    });
    let links = (transports, hub.as_ref());
    // In-process: rank 0 reports epochs; one server's ranks: its first device does.
    let server_mode = local.is_some();
    let work = |ep: Endpoint| {
        let reports = if server_mode {
            ep.device() == 0
        } else {
            ep.rank() == 0
        };
        let callback = reports.then_some(&callback);
        match &popts.machine.compute {
            Compute::Cpu => {
                // The rank runs on its backend's own pool: every kernel then runs in place
                // instead of being handed to a pool thread and waited for. With more ranks
                // than cores those two thread switches per kernel each waited for a time
                // slice: 12-18 % of a 20k-vertex graph's epoch on 2 x 2 ranks, a fixed cost
                // per kernel the planner does not price (docs/benchmarks.md, issue 40).
                let backend = CpuBackend::new(Some(threads_per_rank))?;
                backend.run_within(|b| run_rank::<_, HostNccl>(&shared, b, ep, links, callback))
            }
            Compute::Cuda { .. } => {
                let backend = cuda_rank_backend(&popts.machine.compute, &ep)?;
                match transports.intra {
                    IntraTransport::NcclOnHost => {
                        run_rank::<_, HostNccl>(&shared, backend, ep, links, callback)
                    }
                    _ => {
                        run_rank::<_, crate::links::CudaNccl>(&shared, backend, ep, links, callback)
                    }
                }
            }
        }
    };
    let run_all = || -> anyhow::Result<Vec<RankResult>> {
        let endpoints = match local {
            Some(endpoints) => endpoints,
            None => popts.in_process_endpoints(layout)?,
        };
        grandis_fabric::run_ranks(endpoints, work)
    };
    let labelled_train = |g: u32| in_train_split(labelled_flags, g);
    // Batched steps are small: their producers also read the ranks' features (FLX-EAS
    // plans span whole partitions and are loaded by their rank, once per round).
    let preparer = shared.preparer();
    // CUDA runs have a producer on almost every core, each on a pool of one thread; the fetch
    // stage reads one step's rows at a time, in order. Read on one thread, a products-like
    // step's 223 MB set the pace (a step every ~70 ms); the reads share every core instead (on
    // an H200 the products-like mb epoch of 188 steps went from 13.5 to 9.6 s when reads moved
    // to this pool, docs/benchmarks.md). CPU runs read one step ahead on the process's pool
    // while the ranks compute on the rest.
    let fetch_pool = match &decision.schedule {
        Schedule::FlxSampled { .. } => None,
        _ if popts.machine.compute.is_cuda() && plan_threads > 1 => Some(
            rayon::ThreadPoolBuilder::new()
                .num_threads(std::thread::available_parallelism().map_or(1, |c| c.get()))
                .thread_name(|i| format!("grandis-fetch-{i}"))
                .build()
                .context("starting the step inputs' thread pool")?,
        ),
        _ => None,
    };
    // The graphs and loss rows as soon as the plans exist (small), on the producer's pool;
    // the feature rows once the ranks are near, on the fetch pool where there is one.
    let stage = |step: &crate::steps::Step| -> anyhow::Result<()> {
        let staged = ranks_here
            .iter()
            .map(|&r| Ok((r, HostInput::stage(&preparer, &step.plans, r)?)))
            .collect::<anyhow::Result<Vec<_>>>()?;
        step.set_staged(staged);
        Ok(())
    };
    let read = |step: &crate::steps::Step| -> anyhow::Result<()> {
        let read = || {
            step.take_staged()
                .into_iter()
                .map(|(r, s)| Ok((r, s.read(&preparer, &step.plans, r)?)))
                .collect::<anyhow::Result<Vec<_>>>()
        };
        let inputs = match &fetch_pool {
            Some(pool) => pool.install(read)?,
            None => read()?,
        };
        step.set_prepared(inputs);
        Ok(())
    };
    let fetch = match &decision.schedule {
        Schedule::FlxSampled { .. } => None,
        _ => Some(crate::feed::Fetch {
            stage: &stage,
            read: &read,
            // CPU ranks compute a step for longer than the fetch stage reads the next one's
            // rows, and share the host's memory with them: one step ahead. CUDA ranks take a
            // step every few tens of milliseconds (on an H200, one step ahead left them
            // waiting 43 % of the epoch) and keep their buffers on the device: a few. Not the
            // whole window: with 17 steps ahead the producers kept page-locking fresh buffers
            // and the products-like epoch went from 10.3 s to 10.7 s (mb) and 10.8 s to 14.2 s
            // (cob).
            ahead: if popts.machine.compute.is_cuda() {
                4
            } else {
                1
            },
        }),
    };
    let results = match &decision.schedule {
        Schedule::Static { step, stats } => {
            crate::budget::check_budget(popts.job.device_memory, &stats.model_bytes, "the plan")?;
            // One plan for every epoch: hand it out up front and free the planning context
            // before training.
            for e in 0..epochs as u64 {
                if feed.wants(e) {
                    counts.insert(e, stats.clone(), BuildSeconds::default());
                    feed.push(e, step.clone());
                }
            }
            drop(ctx);
            run_all()?
        }
        schedule => std::thread::scope(|scope| {
            // Every step samples the graph at scattered vertices: were its pages evicted by
            // the feature reads, each neighbour list would be a disk request (at 100M
            // vertices the plan producer took 856 s for an epoch's steps instead of 225 s).
            // The host check above priced it.
            if relied_on > 0 {
                if let Err(e) = part.graph.lock_resident() {
                    tracing::warn!(
                        "could not keep the mapped graph resident ({e}); sampling may read it \
                         from the disk: raise RLIMIT_MEMLOCK (LimitMEMLOCK= for the daemon)"
                    );
                }
            }
            let producer = std::thread::Builder::new()
                .name("grandis-plans".into())
                .spawn_scoped(scope, || {
                    let inputs = StepInputs {
                        ctx: &ctx,
                        dims,
                        step_part: part_here,
                        labelled_train: &labelled_train,
                        link: link_seeds,
                    };
                    crate::feed::produce(
                        &inputs,
                        schedule,
                        epochs,
                        popts.job.device_memory,
                        &feed,
                        &counts,
                        plan_threads,
                        fetch,
                    )
                })
                .context("starting the plan producer thread")?;
            // Without the thread requests are dropped and ranks read as they go.
            let prefetch = std::thread::Builder::new()
                .name("grandis-prefetch".into())
                .spawn_scoped(scope, || prefetcher.serve(shared.features()))
                .inspect_err(|e| tracing::warn!("no feature prefetch thread: {e}"))
                .ok();
            // Without the thread the ranks read the rows asked of them themselves.
            let answers = std::thread::Builder::new()
                .name("grandis-answers".into())
                .spawn_scoped(scope, || answerer.serve(shared.features()))
                .inspect_err(|e| tracing::warn!("no feature answer thread: {e}"))
                .ok();
            let r = run_all();
            feed.close();
            prefetcher.close();
            answerer.close();
            if answers.is_some_and(|a| a.join().is_err()) {
                bail!("the feature answer thread panicked");
            }
            if prefetch.is_some_and(|p| p.join().is_err()) {
                bail!("the feature prefetch thread panicked");
            }
            if producer.join().is_err() {
                bail!("the plan producer thread panicked");
            }
            r
        })?,
    };
    // Every server's counts where the ranks added them up, else this process's (the run's).
    let stats = match results.iter().find_map(|r| r.cluster_counts.clone()) {
        Some(all) => all,
        None => counts.sums(),
    };
    Ok(Ran {
        results,
        stats,
        threads_per_rank,
        transports,
    })
}

/// Sets up and runs one rank on `backend` (wrapped in the byte meter), its halo rows and
/// gradients on `links` (the job's transports and, for device copies, the process's channels;
/// `N` is the NCCL the rank's communicators use).
fn run_rank<B, N>(
    shared: &crate::shared::Shared<'_>,
    backend: B,
    mut ep: Endpoint,
    (transports, hub): (Transports, Option<&CopyHub>),
    callback: Option<&worker::EpochCallback<'_>>,
) -> anyhow::Result<RankResult>
where
    B: grandis_engine::Backend + 'static,
    N: Nccl<metered::Metered<B>> + 'static,
{
    let rank = ep.rank();
    let backend = metered::Metered::new(backend);
    let links =
        crate::links::connect::<_, N>(&backend, &mut ep, transports, hub).with_context(|| {
            format!(
                "connecting rank {rank}'s {} transport",
                transports.intra.name()
            )
        })?;
    let w = worker::Worker::new(shared, &backend, ep, links)
        .with_context(|| format!("setting up rank {rank}"))?;
    w.run(&backend.meter, callback)
}

/// Where steps' feature matrices are read into: page-locked memory for CUDA ranks (their
/// uploads run at full link speed from it), plain memory otherwise or where page-locked
/// memory cannot be had (the rank's backend then says why CUDA fails, if it does).
fn feature_buffers(compute: &Compute, devices: usize) -> crate::prepare::BufferPool {
    if let Ok(Some(&ordinal)) = rank_ordinals(compute, devices).as_ref().map(|o| o.first()) {
        match grandis_engine::cuda::PinnedAllocator::new(ordinal) {
            Ok(pinned) => return crate::prepare::BufferPool::new(Box::new(pinned)),
            Err(e) => tracing::debug!("step features in pageable memory: {e}"),
        }
    }
    crate::prepare::BufferPool::default()
}
