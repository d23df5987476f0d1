//! Training steps and where their plans come from.
//!
//! A *step* is one optimiser step: the per-layer device plan of every rank plus the global
//! number of loss rows (the loss normaliser). Full-batch modes have one step per epoch (FB and
//! exact FLX reuse one plan forever; FLX-EAS swaps in a freshly sampled FLX plan every
//! `--resample-every` epochs); cooperative batching has one co-batch plan per server per
//! iteration; the mini-batch baseline one standalone plan per rank per iteration.
//!
//! Plans are built once per step by producer threads ([`crate::feed::produce`]) and handed to
//! every rank through a bounded [`crate::feed::Feed`], so sampling and extraction of the next iterations overlap with
//! the ranks' compute (as DGL / SALIENT++ sampler workers do) and are never repeated per rank.
//! A step is a pure function of its (epoch, iteration): several producers build steps in
//! parallel and the run stays deterministic.
//! A batched step (cob, mb) is two named stages, [`sample_step`] then [`plan_step`].
//! The producer also counts what each step computes (sampled edges, vertex-layers, β, the
//! memory model's bytes) for the run summary.
//!
//! A process builds the [`StepPart`] of each step its ranks run: every rank's in one process, its
//! own server's under a daemon, so that no part of a step is built twice across a cluster.

use std::sync::{Arc, Mutex};

use crate::link_task::{LinkBatch, LinkSeeds};
use crate::prepare::{HostInput, Staged};
use anyhow::Context;
use grandis_masking::{
    estimate_device, estimate_masked, estimate_masked_device, DevicePlan, ExtractionSpec, FlxPlan,
    Layout, ModelDims, PlanContext,
};
use grandis_sampling::{
    boundary_ratio, round_for_epoch, round_of, ClusterBatches, CoBatcher, MiniBatcher, Saint,
    Sampler,
};
use serde::{Deserialize, Serialize};

/// One optimiser step's plans.
pub(crate) struct Step {
    /// `plans[rank][layer]`: the plan each rank runs each layer on (layers sharing a plan
    /// share the `Arc`).
    pub plans: Vec<Vec<Arc<DevicePlan>>>,
    /// Labelled training rows that are loss rows of some rank in this step (link prediction:
    /// the pairs the step scores over every rank).
    pub targets: usize,
    /// A link job's batched step: the pairs each rank or server scores.
    pub link: StepPairs,
    /// (rank, input but its feature rows) a producer staged for ranks run here, until the
    /// fetch stage reads their rows ([`crate::feed`]).
    staged: Mutex<Vec<(usize, Staged)>>,
    /// (rank, input) prepared for ranks run here; each is taken once.
    prepared: Mutex<Vec<(usize, HostInput)>>,
}

impl Step {
    pub fn new(plans: Vec<Vec<Arc<DevicePlan>>>, targets: usize) -> Step {
        Step {
            plans,
            targets,
            link: StepPairs::None,
            staged: Mutex::default(),
            prepared: Mutex::default(),
        }
    }

    /// Keeps the ranks' staged inputs until their feature rows are read ([`Step::take_staged`]).
    pub fn set_staged(&self, inputs: Vec<(usize, Staged)>) {
        if let Ok(mut s) = self.staged.lock() {
            *s = inputs;
        }
    }

    /// The staged inputs, once (empty if none were staged or they were taken).
    pub fn take_staged(&self) -> Vec<(usize, Staged)> {
        self.staged
            .lock()
            .map(|mut s| std::mem::take(&mut *s))
            .unwrap_or_default()
    }

    /// Hands the ranks run here their inputs, prepared ahead by a producer.
    pub fn set_prepared(&self, inputs: Vec<(usize, HostInput)>) {
        if let Ok(mut p) = self.prepared.lock() {
            *p = inputs;
        }
    }

    /// Rank `rank`'s prepared input, if a producer prepared one and the rank has not taken it.
    pub fn take_prepared(&self, rank: usize) -> Option<HostInput> {
        let mut p = self.prepared.lock().ok()?;
        let i = p.iter().position(|(r, _)| *r == rank)?;
        Some(p.swap_remove(i).1)
    }

    /// Whether rank `rank`'s input is prepared and waiting.
    pub fn is_prepared(&self, rank: usize) -> bool {
        self.prepared
            .lock()
            .is_ok_and(|p| p.iter().any(|(r, _)| *r == rank))
    }
}

/// A link job's pairs in a batched step (every group's, also where another process builds
/// the group's plans: they are a cheap draw, and co-batches lay out their gathered
/// embeddings by every server's).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub(crate) enum StepPairs {
    /// Not a link job's batched step.
    #[default]
    None,
    /// Mode mb: `[rank]`, each rank's batch, over its own targets.
    Ranks(Vec<LinkBatch>),
    /// Mode cob: `[server]`, each server's co-batch, whose targets its devices share.
    Servers(Vec<LinkBatch>),
}

impl StepPairs {
    /// Pairs the step scores over every rank (0 when it is not a link job's batched step).
    pub fn pairs(&self) -> usize {
        match self {
            StepPairs::None => 0,
            StepPairs::Ranks(b) | StepPairs::Servers(b) => b.iter().map(LinkBatch::pairs).sum(),
        }
    }
}

/// Which part of each step this process builds and counts.
///
/// In one process every rank runs here and the whole step is built. Under `cluster up` each
/// server's daemon runs its own ranks: it samples and plans only its server's part of a
/// batched step (its co-batch, its devices' mini-batches) and leaves the other ranks' plans
/// empty (`Step::plans[rank]` has no layers), so no part of a step is built twice across the
/// cluster; the replicated rows another server's ranks need are then asked for by id when
/// the step is loaded (`crate::fetch`). Schedules whose steps need every rank's plans (FB
/// exchanges, FLX-EAS, GraphSAINT and cluster batches) are built whole, and every process
/// counts only its part, so the servers' counts add up to the run's
/// ([`RunStats::merge_servers`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum StepPart {
    All,
    Server(usize),
}

impl StepPart {
    pub fn has_server(self, server: usize) -> bool {
        match self {
            StepPart::All => true,
            StepPart::Server(s) => s == server,
        }
    }

    pub fn has_rank(self, layout: &Layout, rank: usize) -> bool {
        self.has_server(layout.server_of_rank(rank))
    }
}

/// What every step of a run is built from besides its schedule and index.
#[derive(Clone, Copy)]
pub(crate) struct StepInputs<'a> {
    pub ctx: &'a PlanContext<'a>,
    pub dims: &'a ModelDims,
    pub step_part: StepPart,
    /// Whether a vertex (new id) is a labelled training vertex: a loss row where it is a
    /// target.
    pub labelled_train: &'a (dyn Fn(u32) -> bool + Sync),
    /// A link job's supervision edges, where its batches are seeded by them (modes mb, cob)
    /// or are scored inside them (cluster).
    pub link: Option<&'a LinkSeeds<'a>>,
}

/// What one step computes, for the run summary.
#[derive(Debug, Clone, Default)]
pub(crate) struct StepStats {
    pub sampled_edges: u64,
    /// Of those, edges whose two ends are homed on different servers.
    pub inter_server_sampled_edges: u64,
    pub computed_per_layer: Vec<u64>,
    pub aggregated_edges_per_layer: Vec<u64>,
    pub beta: Vec<f64>,
    /// Memory-model bytes of every rank for this step.
    pub model_bytes: Vec<u64>,
    pub targets: u64,
    /// Vertices the servers extracted from other servers (masked plans).
    pub replicated: u64,
}

/// Sums of [`StepStats`] over the run.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub(crate) struct RunStats {
    pub steps: u64,
    pub sampled_edges: u64,
    pub inter_server_sampled_edges: u64,
    pub computed_per_layer: Vec<u64>,
    pub aggregated_edges_per_layer: Vec<u64>,
    pub beta_sum: Vec<f64>,
    pub model_peak: Vec<u64>,
    pub targets: u64,
    pub replicated: u64,
    /// Host seconds spent building the steps counted here (summed over the producer threads):
    /// sampling, plans and, where the producers prepare them, the steps' inputs.
    pub build_seconds: f64,
    /// Of `build_seconds`, the seconds spent reading the steps' feature rows (the fetch
    /// stage) after their plans were built and staged.
    pub inputs_seconds: f64,
}

impl RunStats {
    pub fn add(&mut self, s: &StepStats) {
        self.steps += 1;
        self.sampled_edges += s.sampled_edges;
        self.inter_server_sampled_edges += s.inter_server_sampled_edges;
        self.targets += s.targets;
        self.replicated += s.replicated;
        add_into(&mut self.computed_per_layer, &s.computed_per_layer);
        add_into(
            &mut self.aggregated_edges_per_layer,
            &s.aggregated_edges_per_layer,
        );
        add_into(&mut self.beta_sum, &s.beta);
        self.raise_peaks(&s.model_bytes);
    }

    /// Raises every rank's memory-model peak to at least `model_bytes[rank]`.
    pub fn raise_peaks(&mut self, model_bytes: &[u64]) {
        raise_peaks(&mut self.model_peak, model_bytes);
    }

    /// The run's counts from every server's count of its [`StepPart`] (`servers[s]` from server
    /// `s`): each counted its own ranks and servers, so the counts add up (and a rank's
    /// memory peak, zero elsewhere, is its server's), while the steps and their loss rows are
    /// the whole steps' on every server.
    pub fn merge_servers(servers: &[RunStats]) -> RunStats {
        let mut all = RunStats::default();
        for (s, part) in servers.iter().enumerate() {
            if s == 0 {
                all.steps = part.steps;
                all.targets = part.targets;
            }
            all.sampled_edges += part.sampled_edges;
            all.inter_server_sampled_edges += part.inter_server_sampled_edges;
            all.replicated += part.replicated;
            all.build_seconds += part.build_seconds;
            all.inputs_seconds += part.inputs_seconds;
            add_into(&mut all.computed_per_layer, &part.computed_per_layer);
            add_into(
                &mut all.aggregated_edges_per_layer,
                &part.aggregated_edges_per_layer,
            );
            add_into(&mut all.beta_sum, &part.beta_sum);
            all.raise_peaks(&part.model_peak);
        }
        all
    }
}

/// Raises `peaks[rank]` to at least `bytes[rank]` for every rank (growing `peaks`).
pub(crate) fn raise_peaks(peaks: &mut Vec<u64>, bytes: &[u64]) {
    if peaks.len() < bytes.len() {
        peaks.resize(bytes.len(), 0);
    }
    for (a, &b) in peaks.iter_mut().zip(bytes) {
        *a = (*a).max(b);
    }
}

/// Adds `x` to `acc` element by element (growing `acc` with zeros).
fn add_into<T: Copy + Default + std::ops::AddAssign>(acc: &mut Vec<T>, x: &[T]) {
    if acc.len() < x.len() {
        acc.resize(x.len(), T::default());
    }
    for (a, &b) in acc.iter_mut().zip(x) {
        *a += b;
    }
}

/// How the steps of a run are made.
pub(crate) enum Schedule<'s> {
    /// The same plans every epoch (FB, exact FLX).
    Static { step: Arc<Step>, stats: StepStats },
    /// FLX with a sampled FLX plan (layers `< k`) over the exact FB plan (layers `>= k`),
    /// resampled every `every` epochs.
    FlxSampled {
        k: usize,
        fb: Vec<Arc<DevicePlan>>,
        sampler: &'s dyn Sampler,
        every: Option<u64>,
    },
    /// Cooperative batching: one masked plan (all layers) per iteration.
    Cob {
        batcher: CoBatcher,
        sampler: CobSampler<'s>,
    },
    /// Per-GPU mini-batches: one standalone plan per rank per iteration.
    Mb {
        batcher: MiniBatcher,
        sampler: &'s dyn Sampler,
    },
    /// GraphTheta's cluster batches: one masked plan (all layers) per iteration on the
    /// subgraph a union of clusters induces.
    Cluster { batches: ClusterBatches },
}

/// What builds a co-batch's dependency graph.
pub(crate) enum CobSampler<'s> {
    /// Exact closure, EAS or layer-wise fanout over the co-batch.
    Deps(&'s dyn Sampler),
    /// GraphSAINT: the co-batch slot only sets the iteration count; each server samples its
    /// own subgraph (the unmasked one-hop graph).
    Saint(Saint),
}

impl Schedule<'_> {
    /// Optimiser steps per epoch.
    pub fn iterations(&self) -> usize {
        match self {
            Schedule::Static { .. } | Schedule::FlxSampled { .. } => 1,
            Schedule::Cob { batcher, .. } => batcher.iterations(),
            Schedule::Mb { batcher, .. } => batcher.iterations(),
            Schedule::Cluster { batches } => batches.iterations(),
        }
    }
}

/// One plan shared by every layer (the same `Arc`, so a rank uploads it once).
pub(crate) fn every_layer(d: DevicePlan, layers: usize) -> Vec<Arc<DevicePlan>> {
    let a = Arc::new(d);
    (0..layers).map(|_| a.clone()).collect()
}

/// Counts of a step from the per-layer plans of `part`'s ranks (`beta` and memory filled by
/// the caller).
fn count(
    layout: &Layout,
    plans: &[Vec<Arc<DevicePlan>>],
    layers: usize,
    part: StepPart,
) -> StepStats {
    let mut s = StepStats {
        computed_per_layer: vec![0; layers],
        aggregated_edges_per_layer: vec![0; layers],
        ..Default::default()
    };
    let counted = plans
        .iter()
        .enumerate()
        .filter(|&(r, _)| part.has_rank(layout, r));
    for (_, rank) in counted {
        let mut seen: Vec<&Arc<DevicePlan>> = Vec::new();
        for (l, p) in rank.iter().enumerate() {
            let w = p.work_at(l);
            s.computed_per_layer[l] += w.rows;
            s.aggregated_edges_per_layer[l] += w.edges;
            if !seen.iter().any(|q| Arc::ptr_eq(q, p)) {
                seen.push(p);
                s.sampled_edges += p.num_edges() as u64;
                s.inter_server_sampled_edges += inter_server_edges(layout, p);
            }
        }
    }
    s
}

/// Edges of `p`'s graph whose ends are homed on different servers: what a partition built
/// for sampling locality (ByteGNN's) keeps low.
fn inter_server_edges(layout: &Layout, p: &DevicePlan) -> u64 {
    if layout.servers() == 1 {
        return 0;
    }
    // Each row's home server once, then one load per edge.
    let server: Vec<u32> = p
        .global_ids
        .iter()
        .map(|&g| layout.server_of(g) as u32)
        .collect();
    (0..p.n_owned as u32)
        .map(|i| {
            let home = server[i as usize];
            p.row(i)
                .iter()
                .filter(|&&j| server[j as usize] != home)
                .count() as u64
        })
        .sum()
}

/// Loss rows of a step: labelled training vertices among the inner rows of every rank's
/// last-layer plan.
fn count_targets(plans: &[Vec<Arc<DevicePlan>>], labelled_train: &dyn Fn(u32) -> bool) -> usize {
    plans
        .iter()
        .filter_map(|r| r.last())
        .map(|p| {
            p.global_ids[..p.n_inner]
                .iter()
                .filter(|&&g| labelled_train(g))
                .count()
        })
        .sum()
}

/// β of every server of `part` in `plan` (its device plans moved in and back out); zero for
/// the others.
fn betas(ctx: &PlanContext<'_>, plan: &FlxPlan, part: StepPart) -> Vec<f64> {
    (0..ctx.layout().servers())
        .map(|s| {
            if part.has_server(s) {
                boundary_ratio(ctx, plan, s)
            } else {
                0.0
            }
        })
        .collect()
}

/// Vertices the servers of `part` extracted from other servers.
fn replicated(plan: &FlxPlan, part: StepPart) -> u64 {
    plan.servers
        .iter()
        .enumerate()
        .filter(|&(s, _)| part.has_server(s))
        .map(|(_, e)| e.replicated as u64)
        .sum()
}

/// A masked plan for every layer, as a step with `targets` loss rows (None: counted from the
/// plans, which must then be whole).
fn masked_step(
    inputs: &StepInputs<'_>,
    plan: FlxPlan,
    targets: Option<usize>,
    link: StepPairs,
) -> (Arc<Step>, StepStats) {
    let part = inputs.step_part;
    let beta = betas(inputs.ctx, &plan, part);
    let est = estimate_masked(inputs.dims, &plan);
    let replicated = replicated(&plan, part);
    let plans: Vec<Vec<Arc<DevicePlan>>> = plan
        .devices
        .into_iter()
        .enumerate()
        .map(|(r, d)| built_layers(inputs, r, d))
        .collect();
    let (step, mut stats) = finish(
        inputs,
        plans,
        beta,
        est.devices.iter().map(|d| d.total).collect(),
        targets,
        link,
    );
    stats.replicated = replicated;
    (step, stats)
}

/// Rank `rank`'s per-layer plans of a batched step: `plan` for every layer where this process
/// built the rank's part, none where another process builds it.
fn built_layers(inputs: &StepInputs<'_>, rank: usize, plan: DevicePlan) -> Vec<Arc<DevicePlan>> {
    if inputs.step_part.has_rank(inputs.ctx.layout(), rank) {
        every_layer(plan, inputs.dims.layers)
    } else {
        Vec::new()
    }
}

/// The step of `plans` and its counts over `inputs.step_part`. `targets`: the step's loss rows over
/// every rank; None counts them from `plans`, which must then hold every rank's.
fn finish(
    inputs: &StepInputs<'_>,
    plans: Vec<Vec<Arc<DevicePlan>>>,
    beta: Vec<f64>,
    mut model_bytes: Vec<u64>,
    targets: Option<usize>,
    link: StepPairs,
) -> (Arc<Step>, StepStats) {
    let layout = inputs.ctx.layout();
    let mut stats = count(layout, &plans, inputs.dims.layers, inputs.step_part);
    stats.beta = beta;
    for (r, bytes) in model_bytes.iter_mut().enumerate() {
        if !inputs.step_part.has_rank(layout, r) {
            *bytes = 0;
        }
    }
    stats.model_bytes = model_bytes;
    let t = targets.unwrap_or_else(|| count_targets(&plans, inputs.labelled_train));
    stats.targets = t as u64;
    let mut step = Step::new(plans, t);
    step.link = link;
    (Arc::new(step), stats)
}

/// The static step of an FB / exact FLX run: `fb[r]`, `flx[r]` per rank, FLX for layers `< k`.
pub(crate) fn static_step(
    inputs: &StepInputs<'_>,
    fb: Vec<DevicePlan>,
    flx: Option<FlxPlan>,
    k: usize,
) -> (Arc<Step>, StepStats) {
    let (ctx, dims, part) = (inputs.ctx, inputs.dims, inputs.step_part);
    let layers = dims.layers;
    let model_bytes: Vec<u64> = fb
        .iter()
        .enumerate()
        .map(|(r, d)| estimate_device(dims, k, d, flx.as_ref().map(|f| &f.devices[r])).total)
        .collect();
    let (beta, fb, flx_devices) = match flx {
        Some(f) => (betas(ctx, &f, part), fb, Some(f.devices)),
        None => {
            let wrapper = FlxPlan {
                k: 0,
                servers: Vec::new(),
                devices: fb,
            };
            (betas(ctx, &wrapper, part), wrapper.devices, None)
        }
    };
    let fb: Vec<Arc<DevicePlan>> = fb.into_iter().map(Arc::new).collect();
    let flx: Option<Vec<Arc<DevicePlan>>> =
        flx_devices.map(|v| v.into_iter().map(Arc::new).collect());
    let plans = layered_plans(&fb, flx.as_deref(), k, layers);
    finish(inputs, plans, beta, model_bytes, None, StepPairs::None)
}

/// Every rank's per-layer plans of a full-batch step: its FLX plan for layers `< k` (when
/// there is one), its FB plan above.
fn layered_plans(
    fb: &[Arc<DevicePlan>],
    flx: Option<&[Arc<DevicePlan>]>,
    k: usize,
    layers: usize,
) -> Vec<Vec<Arc<DevicePlan>>> {
    (0..fb.len())
        .map(|r| {
            (0..layers)
                .map(|l| match flx {
                    Some(f) if l < k => f[r].clone(),
                    _ => fb[r].clone(),
                })
                .collect()
        })
        .collect()
}

/// Builds step `it` of `epoch` (0-based both). `prev` is the previous step, which FLX-EAS
/// reuses while its sampling round is unchanged.
pub(crate) fn build_step(
    inputs: &StepInputs<'_>,
    schedule: &Schedule<'_>,
    epoch: u64,
    it: usize,
    prev: Option<&(u64, Arc<Step>, StepStats)>,
) -> anyhow::Result<(u64, Arc<Step>, StepStats)> {
    let (ctx, dims) = (inputs.ctx, inputs.dims);
    let layers = dims.layers;
    match schedule {
        Schedule::Static { step, stats } => Ok((0, step.clone(), stats.clone())),
        Schedule::FlxSampled {
            k,
            fb,
            sampler,
            every,
        } => {
            let round = round_for_epoch(epoch, *every);
            if let Some(p) = prev.filter(|p| p.0 == round) {
                return Ok(p.clone());
            }
            let flx = flx_sampled(ctx, *sampler, *k, round)?;
            let beta = betas(ctx, &flx, inputs.step_part);
            let replicated = replicated(&flx, inputs.step_part);
            let model_bytes = fb
                .iter()
                .enumerate()
                .map(|(r, d)| estimate_device(dims, *k, d, Some(&flx.devices[r])).total)
                .collect();
            let flx: Vec<Arc<DevicePlan>> = flx.devices.into_iter().map(Arc::new).collect();
            let plans = layered_plans(fb, Some(&flx), *k, layers);
            let (step, mut stats) = finish(inputs, plans, beta, model_bytes, None, StepPairs::None);
            stats.replicated = replicated;
            Ok((round, step, stats))
        }
        Schedule::Cob {
            sampler: CobSampler::Saint(s),
            batcher,
        } => {
            let round = round_of(epoch, it, batcher.iterations());
            let plan = s.plan(ctx, layers, round)?;
            let (step, stats) = masked_step(inputs, plan, None, StepPairs::None);
            Ok((round, step, stats))
        }
        Schedule::Cob { .. } | Schedule::Mb { .. } => {
            let sampled = sample_step(inputs, schedule, epoch, it)?;
            plan_step(inputs, sampled)
        }
        Schedule::Cluster { batches } => {
            let round = round_of(epoch, it, batches.iterations());
            let batch = batches.batch(epoch, it)?;
            let plan = batches.plan(ctx, &batch, layers)?;
            // A link job scores each server's supervision edges from its batch to the step's.
            let (targets, link) = match inputs.link {
                Some(seeds) => {
                    let mut all: Vec<u32> = batch.iter().flatten().copied().collect();
                    all.sort_unstable();
                    let link = StepPairs::Servers(
                        batch
                            .iter()
                            .map(|b| seeds.batch_inside(b, &all, epoch + 1))
                            .collect::<anyhow::Result<Vec<_>>>()?,
                    );
                    (Some(link.pairs()), link)
                }
                None => (None, StepPairs::None),
            };
            let (step, stats) = masked_step(inputs, plan, targets, link);
            Ok((round, step, stats))
        }
    }
}

/// Stage 1 of a batched step: every server's (cob) or rank's (mb) sampled dependencies, before
/// any plan exists. A pure function of (epoch, iteration), like the step.
pub(crate) struct SampledStep {
    round: u64,
    /// `[server]` (co-batches, masked over each server's devices) or `[rank]` (mini-batches,
    /// one standalone plan each); empty for the servers or ranks another process builds.
    specs: Vec<ExtractionSpec>,
    per_rank: bool,
    /// Loss rows of the whole step (every server's or rank's batch; a link job's: its pairs).
    targets: usize,
    /// A link job's pairs.
    link: StepPairs,
}

impl SampledStep {
    /// Kept in-edges over every spec (the sampler's output size).
    pub(crate) fn sampled_edges(&self) -> u64 {
        self.specs
            .iter()
            .map(|s| match &s.edges {
                grandis_masking::Edges::Sampled(e) => e.num_edges() as u64,
                grandis_masking::Edges::Exact => 0,
            })
            .sum()
    }
}

/// Samples step `it` of `epoch` of a co-batch schedule with a dependency sampler or of a
/// mini-batch schedule (the other schedules build their plans in one go: [`build_step`]).
pub(crate) fn sample_step(
    inputs: &StepInputs<'_>,
    schedule: &Schedule<'_>,
    epoch: u64,
    it: usize,
) -> anyhow::Result<SampledStep> {
    let (ctx, layers, part) = (inputs.ctx, inputs.dims.layers, inputs.step_part);
    let (mut batch, sampler, per_rank, n) = match schedule {
        Schedule::Cob {
            batcher,
            sampler: CobSampler::Deps(s),
        } => (batcher.batch(epoch, it)?, *s, false, batcher.iterations()),
        Schedule::Mb { batcher, sampler } => (
            batcher.batch(epoch, it)?,
            *sampler,
            true,
            batcher.iterations(),
        ),
        _ => anyhow::bail!("internal: only co-batch and mini-batch steps are sampled apart"),
    };
    let round = round_of(epoch, it, n);
    let layout = ctx.layout();
    // A link job's batches hold supervision edges: their pairs (mode single's draw of
    // negatives for epoch `epoch + 1`, as the ranks count epochs) and, as the targets, the
    // pairs' ends.
    let link: Vec<LinkBatch> = match inputs.link {
        Some(seeds) => {
            let pairs: Vec<LinkBatch> = batch
                .iter()
                .map(|edges| seeds.batch(edges, epoch + 1))
                .collect();
            for (b, p) in batch.iter_mut().zip(&pairs) {
                b.clone_from(&p.targets);
            }
            pairs
        }
        None => Vec::new(),
    };
    // Every batch is a batcher's cheap draw: the loss rows of the whole step come from them,
    // and only this process's part is sampled (the others' batches are emptied; their pairs
    // are kept, see `StepPairs`).
    let link = match (inputs.link, per_rank) {
        (None, _) => StepPairs::None,
        (Some(_), true) => StepPairs::Ranks(link),
        (Some(_), false) => StepPairs::Servers(link),
    };
    let targets = if inputs.link.is_some() {
        link.pairs()
    } else {
        batch
            .iter()
            .flatten()
            .filter(|&&g| (inputs.labelled_train)(g))
            .count()
    };
    for (i, b) in batch.iter_mut().enumerate() {
        let server = if per_rank {
            layout.server_of_rank(i)
        } else {
            i
        };
        if !part.has_server(server) {
            b.clear();
        }
    }
    let specs = if per_rank {
        grandis_sampling::batch_specs::<grandis_sampling::Devices>(
            ctx, &batch, layers, sampler, round,
        )
    } else {
        grandis_sampling::batch_specs::<grandis_sampling::Servers>(
            ctx, &batch, layers, sampler, round,
        )
    }
    .with_context(|| format!("sampling with {}", sampler.name()))?;
    Ok(SampledStep {
        round,
        specs,
        per_rank,
        targets,
        link,
    })
}

/// Stage 2 of a batched step: the plans of a sampled step and what they compute.
pub(crate) fn plan_step(
    inputs: &StepInputs<'_>,
    sampled: SampledStep,
) -> anyhow::Result<(u64, Arc<Step>, StepStats)> {
    let SampledStep {
        round,
        specs,
        per_rank,
        targets,
        link,
    } = sampled;
    let (ctx, dims) = (inputs.ctx, inputs.dims);
    if !per_rank {
        // A co-batch seeded by edges has the ends of its pairs as targets, wherever they live.
        let plan = match link {
            StepPairs::Servers(_) => ctx.extract_pairs_plan(&specs)?,
            _ => ctx.extract_plan(&specs)?,
        };
        let (step, stats) = masked_step(inputs, plan, Some(targets), link);
        return Ok((round, step, stats));
    }
    let devices = grandis_sampling::mb_device_plans(ctx, &specs)?;
    let model_bytes = devices
        .iter()
        .map(|d| estimate_masked_device(dims, d).total)
        .collect();
    let wrapper = FlxPlan {
        k: dims.layers,
        servers: Vec::new(),
        devices,
    };
    let beta = betas(ctx, &wrapper, inputs.step_part);
    let plans = wrapper
        .devices
        .into_iter()
        .enumerate()
        .map(|(r, d)| built_layers(inputs, r, d))
        .collect();
    let (step, stats) = finish(inputs, plans, beta, model_bytes, Some(targets), link);
    Ok((round, step, stats))
}

/// The sampled FLX plan with `k` hops: every server's whole range as targets.
pub(crate) fn flx_sampled(
    ctx: &PlanContext<'_>,
    sampler: &dyn Sampler,
    k: usize,
    round: u64,
) -> anyhow::Result<FlxPlan> {
    let layout = ctx.layout();
    let specs = (0..layout.servers())
        .map(|s| sampler.spec(ctx, s, layout.server_range(s).collect(), k, round))
        .collect::<Result<Vec<_>, _>>()
        .with_context(|| format!("sampling the FLX plan with {}", sampler.name()))?;
    Ok(ctx.extract_plan(&specs)?)
}

/// What a producer built for one step: its sampling round, the step, and its counts.
pub(crate) type Built = (u64, Arc<Step>, StepStats);

#[cfg(test)]
mod tests {
    use super::*;
    use grandis_wire::Sampling;

    use crate::plan_context;
    use crate::setup::{in_train_split, labelled};
    use crate::test_support::{random_2x2, synth};

    /// A server's part of a batched step is the whole step's plans of its ranks (the others'
    /// left empty) with the whole step's loss rows, and the servers' counts of their parts add
    /// up to the whole step's: cob and mb, sampled and exact.
    #[test]
    fn a_servers_part_of_a_step_is_its_share_of_the_whole() {
        let ds = synth(500, 9);
        let view = ds.view();
        let part = random_2x2(&view, 2);
        let layout = &part.layout;
        let ctx = plan_context(&view, &part).unwrap();
        let (flags, _) = labelled(&view, &part).unwrap();
        let labelled_train = |g: u32| in_train_split(&flags, g);
        let dims = crate::budget::model_dims(&grandis_models::ModelConfig {
            heads: 1,
            dropout: 0.0,
            ..grandis_models::ModelConfig::new(
                grandis_models::ModelKind::Sage,
                2,
                view.feature_dim,
                8,
                view.num_classes,
            )
        });
        let inputs = |step_part| StepInputs {
            ctx: &ctx,
            dims: &dims,
            step_part,
            labelled_train: &labelled_train,
            link: None,
        };
        for sampling in [
            Sampling::Fanout {
                fanouts: vec![5, 3],
                relation_fanouts: Default::default(),
            },
            Sampling::None,
        ] {
            let sampler = grandis_sampling::dependency_sampler(&sampling, 2, 3, None)
                .unwrap()
                .unwrap_or_else(|| Box::new(grandis_sampling::Exact));
            let schedules = [
                Schedule::Cob {
                    batcher: CoBatcher::new(&ctx, 30, 3).unwrap(),
                    sampler: CobSampler::Deps(sampler.as_ref()),
                },
                Schedule::Mb {
                    batcher: MiniBatcher::new(&ctx, 15, 3).unwrap(),
                    sampler: sampler.as_ref(),
                },
            ];
            for schedule in &schedules {
                for it in 0..schedule.iterations().min(3) {
                    let (_, whole, whole_stats) =
                        build_step(&inputs(StepPart::All), schedule, 1, it, None).unwrap();
                    let mut counts = Vec::new();
                    for s in 0..layout.servers() {
                        let (_, step, stats) =
                            build_step(&inputs(StepPart::Server(s)), schedule, 1, it, None)
                                .unwrap();
                        assert_eq!(step.targets, whole.targets);
                        for (r, plans) in step.plans.iter().enumerate() {
                            if layout.server_of_rank(r) == s {
                                assert_eq!(plans, &whole.plans[r], "rank {r} iteration {it}");
                            } else {
                                assert!(plans.is_empty(), "server {s} built rank {r}'s part");
                            }
                        }
                        let mut run = RunStats::default();
                        run.add(&stats);
                        counts.push(run);
                    }
                    let mut all = RunStats::default();
                    all.add(&whole_stats);
                    assert_eq!(RunStats::merge_servers(&counts), all, "iteration {it}");
                    assert!(all.sampled_edges > 0);
                }
            }
        }
    }
}
