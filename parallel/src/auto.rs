//! `mode = auto`: the plan the performance model predicts fastest among those that fit
//! ([`crate::planner`]), decided where the run starts.
//!
//! - **Rates** ([`plan_rates`]): what the servers measured when the job started
//!   ([`crate::measure::server_rates`]; a run of every rank in one process measures its own
//!   fabric and one rank's compute here), the slowest server's of each (the ranks run in lock
//!   step), with the contention of ranks sharing a machine's cores and, on CPUs, a calibration
//!   of the job's model on a sample of its graph.
//! - **Candidates** ([`plan_job`]): fb, exact flx for every k, flx-eas over hops {1, 2} ×
//!   fanout {5, 15}, cob with the job's co-batch size (else the largest that fits the budget)
//!   and its half and quarter, mb; a `preload_hops` in the job keeps only the static plans of
//!   that k. Counted with [`Counting::Pruned`]: a static plan is counted only when its floors
//!   leave it able to be chosen.
//! - **Agreement** (a daemon's ranks): every server sends its measured rates to global rank
//!   0, which plans once and sends the choice (or its error) back to every server's head, so
//!   all servers run the same plan whatever their clocks said.

use std::time::{Duration, Instant};

use anyhow::{bail, Context};
use grandis_fabric::{Endpoint, Phase, Tag, PROBE_EPOCH};
use grandis_models::ModelConfig;
use grandis_store::DatasetView;
use grandis_wire::{
    CandidateSummary, ComputeRate, LinkRate, Mode, PlanRates, PlanSummary, Sampling, ServerRates,
};
use serde::{Deserialize, Serialize};

use crate::planner::{candidates, choose, plan, Candidate, Counting, Planned};
use crate::{Compute, ParallelOptions, PartitionedGraph};

/// How long a server waits for the first server's plan (counting large static plans takes
/// minutes; a lost peer still fails the wait at once).
const PLAN_WAIT: Duration = Duration::from_secs(3600);

/// The options to run with: `popts` itself for fb, flx, cob and mb; for auto, the planner's
/// choice and its summary. `local`: this server's endpoints when the run is one server's
/// ranks (they agree with the other servers); None when every rank runs in this process.
pub(crate) fn resolve_mode(
    view: &DatasetView<'_>,
    part: &PartitionedGraph,
    config: &ModelConfig,
    popts: &ParallelOptions,
    seed: u64,
    local: Option<&mut [Endpoint]>,
) -> anyhow::Result<(ParallelOptions, Option<PlanSummary>)> {
    match popts.job.mode {
        Mode::Fb | Mode::Flx | Mode::Cob | Mode::Mb | Mode::Cluster => Ok((popts.clone(), None)),
        Mode::Auto => {
            let (g, world) = (part.layout.devices(), part.layout.num_ranks());
            let choose_with = |servers: &[ServerRates], placement: Placement| {
                let rates = plan_rates(*view, config, servers, &placement)?;
                let planned = plan_job(*view, part, config, popts, seed, rates, true)?;
                planned.chosen()
            };
            let chosen = match local {
                None => {
                    let measured = match &popts.machine.measured {
                        Some(m) => m.clone(),
                        None => crate::measure::in_process_rates(popts, &part.layout, config)?,
                    };
                    let placement = Placement {
                        compute: popts.machine.compute.clone(),
                        threads_per_rank: popts.rank_threads(world),
                        ranks_per_machine: world,
                        one_machine: true,
                    };
                    choose_with(&[measured], placement)?
                }
                Some(endpoints) => {
                    let measured = popts.machine.measured.as_ref().context(
                        "mode auto on a server: the server's rates must be measured first",
                    )?;
                    let shared = popts.machine.servers_share_machine;
                    let placement = Placement {
                        compute: popts.machine.compute.clone(),
                        threads_per_rank: popts.rank_threads(g),
                        ranks_per_machine: if shared { world } else { g },
                        one_machine: shared,
                    };
                    agree(endpoints, measured, |all| choose_with(all, placement))?
                }
            };
            tracing::info!(
                chosen = %chosen.summary.chosen,
                predicted_epoch_s = chosen.summary.prediction.epoch_s,
                why = %chosen.summary.why,
                "mode auto"
            );
            Ok((chosen.candidate.options(popts), Some(chosen.summary)))
        }
        Mode::Single => bail!(
            "mode single is the single-process trainer (`grandis train --mode single`); the \
             partition-parallel modes are {}",
            Mode::DISTRIBUTED_NAMES
        ),
    }
}

/// Where a job's ranks run, as the rates' contention and calibration see it.
#[derive(Debug, Clone)]
pub struct Placement {
    pub compute: Compute,
    /// CPU threads of each rank.
    pub threads_per_rank: usize,
    /// Ranks sharing one machine: a server's devices, or every rank when one machine runs
    /// them all.
    pub ranks_per_machine: usize,
    /// One machine runs every rank (in-process `grandis train`): its plan builders share the
    /// ranks' cores too.
    pub one_machine: bool,
}

/// The rates a plan is predicted with: the slowest of `servers`' measured rates (every step
/// waits for its slowest rank), the contention of `placement`'s CPU ranks on this machine's
/// cores, and on CPUs a calibration of `config` on a sample of `view` (GPUs: 1, not
/// calibrated).
pub fn plan_rates(
    view: DatasetView<'_>,
    config: &ModelConfig,
    servers: &[ServerRates],
    placement: &Placement,
) -> anyhow::Result<PlanRates> {
    let first = servers.first().context("no measured server")?;
    let slowest = |f: fn(&ComputeRate) -> f64| {
        servers
            .iter()
            .map(|s| f(&s.compute))
            .fold(f64::INFINITY, f64::min)
    };
    let compute = ComputeRate {
        gemm_flops_per_s: slowest(|c| c.gemm_flops_per_s),
        aggregation_edge_cols_per_s: slowest(|c| c.aggregation_edge_cols_per_s),
        aggregation_uncached_edge_cols_per_s: slowest(|c| c.aggregation_uncached_edge_cols_per_s),
        width: first.compute.width,
        // The slowest server's rows (an older server's rates, without any, count as 0).
        aggregation_row_edges: servers
            .iter()
            .map(|s| s.compute.aggregation_row_edges)
            .fold(0.0, f64::max),
    };
    let link = |pick: fn(&ServerRates) -> Option<LinkRate>| {
        let links: Vec<LinkRate> = servers.iter().filter_map(pick).collect();
        match links.is_empty() {
            // Unused by the topology (one device, or one server): no time.
            true => LinkRate::default(),
            false => LinkRate {
                bandwidth_bytes_per_s: links
                    .iter()
                    .map(|l| l.bandwidth_bytes_per_s)
                    .fold(f64::INFINITY, f64::min),
                latency_s: links.iter().map(|l| l.latency_s).fold(0.0, f64::max),
            },
        }
    };
    let cpu = matches!(placement.compute, Compute::Cpu);
    let cores = std::thread::available_parallelism().map_or(1, |c| c.get());
    let calibration = match cpu {
        true => crate::planner::calibrate(view, config, &compute, placement.threads_per_rank)
            .context("calibrating the model on a sample of the graph")?,
        false => Default::default(),
    };
    Ok(PlanRates {
        compute,
        intra: link(|s| s.intra),
        inter: link(|s| s.inter),
        contention: match cpu {
            true => ((placement.ranks_per_machine * placement.threads_per_rank) as f64
                / cores as f64)
                .max(1.0),
            false => 1.0,
        },
        calibration: calibration.step,
        kernel_calibration: calibration.kernels,
        shared_cores: (placement.one_machine && cpu).then_some(cores),
        cache_sharers: match cpu {
            true => placement
                .ranks_per_machine
                .min(cores / placement.threads_per_rank.max(1))
                .max(1) as f64,
            false => 1.0,
        },
    })
}

/// A job's candidates counted and predicted, and the planner's choice.
#[derive(Debug, Clone, Serialize)]
pub struct JobPlan {
    pub planned: Vec<Planned>,
    /// The index of the chosen candidate in `planned`, and why; None when nothing fits.
    pub chosen: Option<(usize, String)>,
    pub rates: PlanRates,
    pub exact_preference: f64,
    /// The per-device budget the candidates had to fit.
    pub budget: u64,
    /// Why there are no cob and mb candidates (not even a co-batch of one fits).
    pub no_cobatch: Option<String>,
    /// Seconds the planning took (not the rates' measurement).
    pub seconds: f64,
}

/// The chosen candidate and the summary a run reports.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct Chosen {
    pub candidate: Candidate,
    pub summary: PlanSummary,
}

impl JobPlan {
    /// The choice, or an error naming why each candidate was left out.
    pub fn chosen(&self) -> anyhow::Result<Chosen> {
        let Some((i, why)) = &self.chosen else {
            let reasons: Vec<String> = self
                .planned
                .iter()
                .map(|p| format!("{}: {}", p.name, note(p, self.budget)))
                .chain(self.no_cobatch.iter().map(|e| format!("cob and mb: {e}")))
                .collect();
            bail!(
                "mode auto: no plan fits the {}-byte budget per device ({})",
                self.budget,
                reasons.join("; ")
            );
        };
        let p = &self.planned[*i];
        Ok(Chosen {
            candidate: p.candidate.clone(),
            summary: PlanSummary {
                chosen: p.name.clone(),
                why: why.clone(),
                prediction: p.prediction.clone().unwrap_or_default(),
                rates: self.rates,
                candidates: self
                    .planned
                    .iter()
                    .map(|p| CandidateSummary {
                        name: p.name.clone(),
                        epoch_s: p.prediction.as_ref().map(|x| x.epoch_s),
                        peak_bytes: p.prediction.as_ref().map(|x| x.peak_bytes),
                        fits: p.fits,
                        note: (!p.fits).then(|| note(p, self.budget)),
                    })
                    .collect(),
                exact_preference: self.exact_preference,
                seconds: self.seconds,
            },
        })
    }
}

/// Why `p` cannot be chosen: not counted, cannot run, or over the budget.
fn note(p: &Planned, budget: u64) -> String {
    match (&p.pruned, &p.error, &p.prediction) {
        (Some(why), _, _) => format!("not counted: {why}"),
        (_, Some(e), _) => format!("cannot run: {e}"),
        (_, _, Some(x)) if x.peak_bytes > budget => {
            format!(
                "needs {} bytes, over the {budget}-byte budget",
                x.peak_bytes
            )
        }
        _ => "fits".into(),
    }
}

/// Plans `popts`' job (its sampler, budget, co-batch size, preload hops and exact
/// preference) with `rates`: every candidate counted, or (`prune`) as [`Counting::Pruned`].
pub fn plan_job(
    view: DatasetView<'_>,
    part: &PartitionedGraph,
    config: &ModelConfig,
    popts: &ParallelOptions,
    seed: u64,
    rates: PlanRates,
    prune: bool,
) -> anyhow::Result<JobPlan> {
    let started = Instant::now();
    let (budget, _) = crate::budget::budget(popts, &part.layout)?;
    let mut base = popts.clone();
    base.job.device_memory = Some(budget);
    // One plan context (the graph's transpose, the splits) for the co-batch search and the
    // counting.
    let ctx = crate::plan_context(&view, part)?;
    // A link job's co-batches are supervision edges (`link_task::LinkSeeds`), a node
    // classification job's its training vertices: the largest of either that fits.
    let task = popts.job.task;
    let largest = match task {
        grandis_wire::Task::Link => {
            largest_link_cobatch(&view, part, &ctx, config, popts, budget, seed)
        }
        grandis_wire::Task::Node => {
            largest_cobatch(&view, part, &ctx, config, &popts.job.sampling, budget, seed)
        }
    };
    let (batch, no_cobatch) = match (popts.batch_size(), largest) {
        (Some(b), _) => (b, None),
        (None, Ok(b)) => (b, None),
        (None, Err(e)) => (0, Some(format!("{e:#}"))),
    };
    let cands: Vec<Candidate> = candidates(
        config.layers,
        batch,
        part.layout.devices(),
        &popts.job.sampling,
    )
    .into_iter()
    .filter(|c| match (c.mode, popts.preload_hops()) {
        (Mode::Fb | Mode::Flx, Some(k)) => c.preload_hops.unwrap_or(0) == k,
        _ => true,
    })
    .filter(|c| grandis_wire::task_conflict(task, c.mode, &c.sampling).is_none())
    .collect();
    let counting = match prune {
        true => Counting::Pruned {
            exact_preference: popts.exact_preference(),
        },
        false => Counting::Every,
    };
    let planned = plan(
        view, part, &ctx, config, seed, &base, &cands, &rates, counting,
    )?;
    let chosen = choose(&planned, popts.exact_preference());
    Ok(JobPlan {
        planned,
        chosen,
        rates,
        exact_preference: popts.exact_preference(),
        budget,
        no_cobatch,
        seconds: started.elapsed().as_secs_f64(),
    })
}

/// The largest co-batch whose plan fits `budget` with the sampler cob would train with
/// (`sampling`; GraphSAINT's subgraphs are not co-batches, so exact then); an error when not
/// even one vertex fits (the cob and mb candidates are then left out).
fn largest_cobatch(
    view: &DatasetView<'_>,
    part: &PartitionedGraph,
    ctx: &grandis_masking::PlanContext<'_>,
    config: &ModelConfig,
    sampling: &Sampling,
    budget: u64,
    seed: u64,
) -> anyhow::Result<usize> {
    let dims = crate::model_dims(config);
    let sampling = match sampling {
        Sampling::Saint { .. } => Sampling::None,
        s => s.clone(),
    };
    let sampler = crate::setup::dependency_sampler(view, part, &sampling, config.layers, seed)?
        .unwrap_or_else(|| Box::new(grandis_sampling::Exact));
    let fit = grandis_sampling::largest_cobatch(ctx, &dims, budget, sampler.as_ref(), seed)?;
    Ok(fit.batch_size)
}

/// The largest co-batch of supervision edges per server whose first step fits `budget` on
/// every rank (the memory model of the step a cob run builds first, the decoder's gathered
/// embeddings included), with the sampler cob would train with: the node-classification
/// search's rule (`grandis_sampling::largest_cobatch`) over edge-seeded co-batches.
fn largest_link_cobatch(
    view: &DatasetView<'_>,
    part: &PartitionedGraph,
    ctx: &grandis_masking::PlanContext<'_>,
    config: &ModelConfig,
    popts: &ParallelOptions,
    budget: u64,
    seed: u64,
) -> anyhow::Result<usize> {
    let (grandis_trainer::Objective::Link { negatives, .. }, Some(split)) =
        (grandis_trainer::Objective::for_job(&popts.job), view.links)
    else {
        bail!("internal: a link job without a link split");
    };
    let seeds = crate::link_task::LinkSeeds::new(
        crate::link_task::LinkTask { split, negatives },
        part,
        seed,
        false,
    );
    let (flags, _) = crate::setup::labelled(view, part)?;
    let labelled_train = |g: u32| crate::setup::in_train_split(&flags, g);
    let sampling = match &popts.job.sampling {
        Sampling::Saint { .. } => Sampling::None,
        s => s.clone(),
    };
    let sampler = crate::setup::dependency_sampler(view, part, &sampling, config.layers, seed)?;
    // The most supervision edges one server holds (edges go to their source's server).
    let layout = &part.layout;
    let mut per_server = vec![0usize; layout.servers()];
    for s in seeds.sources() {
        per_server[layout.server_of(s)] += 1;
    }
    let most = per_server.iter().copied().max().unwrap_or(0);
    if most == 0 {
        bail!("no supervision edges: cooperative batching has nothing to batch");
    }
    let peak = |b: usize| -> anyhow::Result<u64> {
        let mut cob = popts.clone();
        cob.job.mode = Mode::Cob;
        cob.job.batch_size = Some(b as u32);
        cob.job.sampling = sampling.clone();
        cob.job.device_memory = Some(budget);
        let dims = crate::budget::job_dims(config, &cob.job, view.num_vertices());
        let inputs = crate::steps::StepInputs {
            ctx,
            dims: &dims,
            step_part: crate::steps::StepPart::All,
            labelled_train: &labelled_train,
            link: Some(&seeds),
        };
        let decision = crate::decide::decide(&inputs, config, &cob, sampler.as_deref(), seed)?;
        let (_, _, stats) = crate::steps::build_step(&inputs, &decision.schedule, 0, 0, None)?;
        Ok(stats.model_bytes.iter().copied().max().unwrap_or(0))
    };
    let one = peak(1)?;
    if one > budget {
        bail!(
            "memory budget of {budget} bytes is too small: even a co-batch of 1 supervision \
             edge needs {one} bytes"
        );
    }
    grandis_sampling::largest_fitting(most, |b| Ok(peak(b)? <= budget))
}

/// Every server's `measured` rates to global rank 0, which runs `decide` on them once; its
/// choice (or error) back to every server. Collective over the job's servers: this server's
/// head among `local` takes part, its other ranks wait in this process.
fn agree(
    local: &mut [Endpoint],
    measured: &ServerRates,
    decide: impl FnOnce(&[ServerRates]) -> anyhow::Result<Chosen>,
) -> anyhow::Result<Chosen> {
    let tag = Tag::new(PROBE_EPOCH, 1, Phase::Other);
    let head = local
        .iter_mut()
        .find(|e| e.is_head())
        .context("this server's endpoints have no head")?;
    let servers = head.servers();
    let topology = head.topology();
    let saved = head.recv_timeout();
    if head.rank() != 0 {
        head.send_bytes(0, serde_json::to_vec(measured)?, tag)?;
        head.set_recv_timeout(PLAN_WAIT);
        let reply = head.recv_bytes(0, tag);
        head.set_recv_timeout(saved);
        let reply: Result<Chosen, String> =
            serde_json::from_slice(&reply?).context("the first server's plan is not valid JSON")?;
        return reply.map_err(|e| anyhow::anyhow!("the job's first server could not plan: {e}"));
    }
    let mut all = vec![measured.clone()];
    for s in 1..servers {
        let bytes = head.recv_bytes(topology.head_of(s), tag)?;
        all.push(
            serde_json::from_slice(&bytes)
                .with_context(|| format!("server {s}'s measured rates are not valid JSON"))?,
        );
    }
    let decided = decide(&all);
    let reply: Result<&Chosen, String> = decided.as_ref().map_err(|e| format!("{e:#}"));
    let bytes = serde_json::to_vec(&reply)?;
    for s in 1..servers {
        head.send_bytes(topology.head_of(s), bytes.clone(), tag)?;
    }
    decided
}
