//! Cooperative batching (GraNNDIS §5.2) and the per-GPU mini-batch baseline (DistDGL /
//! SALIENT++ style).
//!
//! CoB: per iteration each SERVER takes a co-batch of at most B of its training vertices and
//! builds ONE dependency graph (MFG) for it — which may include vertices of other servers,
//! replicated — spread over its G devices with one-hop masking: [`cob_plan`] is
//! `PlanContext::extract_plan` with targets = the co-batches and `hops` = the number of layers
//! (every layer masked; no reshape). Epochs: each server shuffles its training vertices with a
//! seeded permutation per epoch and cuts them into `iterations` near-equal consecutive chunks,
//! where `iterations = max over servers of ceil(train_s / B)` so every server steps in every
//! iteration (synchronous all-reduce) and every chunk has at most B vertices; an epoch covers
//! every training vertex exactly once.
//!
//! MB: every DEVICE takes its own mini-batch of at most b training vertices of its own range
//! and builds its own MFG (`PlanContext::extract_device_plan`: no halo, no sharing with the
//! other devices of its server). Computed vertex-layers and memory are summed / maxed over
//! the devices' plans, which is where the redundancy CoB removes shows up.

use grandis_masking::{
    estimate_masked, estimate_masked_device, DevicePlan, ExtractionSpec, FlxPlan, ModelDims,
    PlanContext, SPLIT_TRAIN,
};
use rand::seq::SliceRandom;

use crate::error::{Result, SamplingError};
use crate::rng::rng;
use crate::sampler::{round_of, Sampler};
use crate::stats::{add, device_counts};

/// Shuffled, chunked epochs over per-group training lists (a group is a server for CoB, a
/// device rank for MB).
#[derive(Debug, Clone, PartialEq, Eq)]
struct Epochs {
    train: Vec<Vec<u32>>,
    batch_size: usize,
    seed: u64,
    iterations: usize,
    salt: u64,
}

impl Epochs {
    fn new(train: Vec<Vec<u32>>, batch_size: usize, seed: u64, salt: u64) -> Result<Epochs> {
        if batch_size == 0 {
            return Err(SamplingError::Config(
                "batch size must be at least 1".into(),
            ));
        }
        let iterations = train
            .iter()
            .map(|t| t.len().div_ceil(batch_size))
            .max()
            .unwrap_or(0);
        Ok(Epochs {
            train,
            batch_size,
            seed,
            iterations,
            salt,
        })
    }

    /// Group `g`'s chunk `iteration` of `epoch` (sorted).
    fn chunk(&self, g: usize, epoch: u64, iteration: usize) -> Vec<u32> {
        let mut order = self.train[g].clone();
        order.shuffle(&mut rng(&[self.seed, epoch, g as u64, self.salt]));
        let t = order.len();
        let n = self.iterations.max(1);
        let (a, b) = (t * iteration / n, t * (iteration + 1) / n);
        let mut out = order[a..b].to_vec();
        out.sort_unstable();
        out
    }

    fn batch(&self, epoch: u64, iteration: usize) -> Result<Vec<Vec<u32>>> {
        if iteration >= self.iterations {
            return Err(SamplingError::Config(format!(
                "iteration {iteration} of an epoch with {} iterations",
                self.iterations
            )));
        }
        Ok((0..self.train.len())
            .map(|g| self.chunk(g, epoch, iteration))
            .collect())
    }
}

/// Training vertices of every server (or of every rank when `per_rank`), from the context's
/// split flags.
fn train_lists(ctx: &PlanContext<'_>, per_rank: bool) -> Vec<Vec<u32>> {
    let layout = ctx.layout();
    let groups = if per_rank {
        layout.num_ranks()
    } else {
        layout.servers()
    };
    (0..groups)
        .map(|g| {
            let range = if per_rank {
                layout.range(g)
            } else {
                layout.server_range(g)
            };
            range
                .filter(|&v| ctx.splits().flags(v) & SPLIT_TRAIN != 0)
                .collect()
        })
        .collect()
}

/// The indices of the edges whose source (`sources[i]`, a new id) each group holds
/// (`[group]`, ascending): the owning server's (`per_rank` false) or rank's.
fn edges_by_owner(ctx: &PlanContext<'_>, sources: &[u32], per_rank: bool) -> Result<Vec<Vec<u32>>> {
    let layout = ctx.layout();
    let groups = if per_rank {
        layout.num_ranks()
    } else {
        layout.servers()
    };
    let mut lists = vec![Vec::new(); groups];
    for (i, &u) in sources.iter().enumerate() {
        if u >= layout.num_vertices() {
            return Err(SamplingError::Config(format!(
                "supervision edge {i}: source {u} is not a vertex (the graph has {})",
                layout.num_vertices()
            )));
        }
        let owner = layout.owner(u);
        let group = if per_rank {
            owner
        } else {
            layout.server_of_rank(owner)
        };
        lists[group].push(i as u32);
    }
    Ok(lists)
}

/// Who a batch belongs to: a server ([`Servers`], co-batches) or a device rank
/// ([`Devices`], mini-batches), and the salts that keep their shuffles apart.
pub trait Grouping {
    /// One batch per device rank (else one per server).
    const PER_RANK: bool;
    /// Salt of the shuffles over training vertices.
    const SALT: u64;
    /// Salt of the shuffles over supervision edges.
    const EDGE_SALT: u64;
}

/// Batches per server: CoB's co-batches.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Servers;
impl Grouping for Servers {
    const PER_RANK: bool = false;
    const SALT: u64 = 0xC0B;
    const EDGE_SALT: u64 = 0xC0B_ED6E;
}

/// Batches per device rank: the MB baseline's mini-batches.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Devices;
impl Grouping for Devices {
    const PER_RANK: bool = true;
    const SALT: u64 = 0x3B;
    const EDGE_SALT: u64 = 0x1ED6E;
}

/// Co-batches of every server, epoch by epoch.
pub type CoBatcher = Batcher<Servers>;
/// Per-device mini-batches of the MB baseline, epoch by epoch.
pub type MiniBatcher = Batcher<Devices>;

/// Batches of every group `G` (server or rank), epoch by epoch.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Batcher<G> {
    epochs: Epochs,
    grouping: std::marker::PhantomData<G>,
}

impl<G: Grouping> Batcher<G> {
    /// Batches of at most `batch_size` training vertices (the context's SPLIT_TRAIN rows) per
    /// group: of each server, or of each device's own range.
    pub fn new(ctx: &PlanContext<'_>, batch_size: usize, seed: u64) -> Result<Batcher<G>> {
        Ok(Batcher {
            epochs: Epochs::new(train_lists(ctx, G::PER_RANK), batch_size, seed, G::SALT)?,
            grouping: std::marker::PhantomData,
        })
    }
    /// Batches seeded by edges (link prediction, PyG's `LinkNeighborLoader`): at most
    /// `batch_size` supervision edges per group, each edge dealt to the server or rank that
    /// owns its source (`sources[i]`, a new id, is edge `i`'s), so that a batch's sources are
    /// its own vertices. A batch holds edge indices instead of vertices.
    pub fn for_edges(
        ctx: &PlanContext<'_>,
        sources: &[u32],
        batch_size: usize,
        seed: u64,
    ) -> Result<Batcher<G>> {
        Ok(Batcher {
            epochs: Epochs::new(
                edges_by_owner(ctx, sources, G::PER_RANK)?,
                batch_size,
                seed,
                G::EDGE_SALT,
            )?,
            grouping: std::marker::PhantomData,
        })
    }
    pub fn batch_size(&self) -> usize {
        self.epochs.batch_size
    }
    /// Iterations per epoch (0 when no group has a training vertex).
    pub fn iterations(&self) -> usize {
        self.epochs.iterations
    }
    /// Training vertices (or supervision edges) of each group.
    pub fn train(&self) -> &[Vec<u32>] {
        &self.epochs.train
    }
    /// The batch of every group (`[group]`, sorted) at `iteration` of `epoch`.
    pub fn batch(&self, epoch: u64, iteration: usize) -> Result<Vec<Vec<u32>>> {
        self.epochs.batch(epoch, iteration)
    }
    /// Every iteration's batches of `epoch` (`[iteration][group]`).
    pub fn epoch(&self, epoch: u64) -> Vec<Vec<Vec<u32>>> {
        (0..self.iterations())
            .map(|i| self.epochs.batch(epoch, i).expect("iteration in range"))
            .collect()
    }
}

/// One iteration's extraction specs, one per group (`[group]`): server s samples its
/// co-batch `batch[s]` ([`Servers`], CoB), or rank r its mini-batch `batch[r]` for its server
/// ([`Devices`], MB), with `sampler` over `layers` hops.
pub fn batch_specs<G: Grouping>(
    ctx: &PlanContext<'_>,
    batch: &[Vec<u32>],
    layers: usize,
    sampler: &dyn Sampler,
    round: u64,
) -> Result<Vec<ExtractionSpec>> {
    let layout = ctx.layout();
    let (groups, batches, of) = if G::PER_RANK {
        (layout.num_ranks(), "mini-batches", "devices")
    } else {
        (layout.servers(), "co-batches", "servers")
    };
    if batch.len() != groups {
        return Err(SamplingError::Config(format!(
            "{} {batches} given for {groups} {of}",
            batch.len()
        )));
    }
    batch
        .iter()
        .enumerate()
        .map(|(g, t)| {
            let server = if G::PER_RANK {
                layout.server_of_rank(g)
            } else {
                g
            };
            sampler.spec(ctx, server, t.clone(), layers, round)
        })
        .collect()
}

/// The CoB plan of one iteration: server s extracts `batch[s]` with `sampler` over `layers`
/// hops (all layers masked). Loss rows are `DevicePlan::loss_rows()` (the co-batch rows).
pub fn cob_plan(
    ctx: &PlanContext<'_>,
    batch: &[Vec<u32>],
    layers: usize,
    sampler: &dyn Sampler,
    round: u64,
) -> Result<FlxPlan> {
    let specs = batch_specs::<Servers>(ctx, batch, layers, sampler, round)?;
    Ok(ctx.extract_plan(&specs)?)
}

/// Every rank's standalone MFG from its spec (`specs[rank]`, as [`batch_specs`] gives them
/// for [`Devices`]).
pub fn mb_device_plans(ctx: &PlanContext<'_>, specs: &[ExtractionSpec]) -> Result<Vec<DevicePlan>> {
    let layout = ctx.layout();
    specs
        .iter()
        .enumerate()
        .map(|(r, spec)| Ok(ctx.extract_device_plan(spec, layout.device_of_rank(r))?))
        .collect()
}

/// The MB plans of one iteration: rank r's own MFG for `batch[r]` (`[rank]`).
pub fn mb_plans(
    ctx: &PlanContext<'_>,
    batch: &[Vec<u32>],
    layers: usize,
    sampler: &dyn Sampler,
    round: u64,
) -> Result<Vec<DevicePlan>> {
    mb_device_plans(
        ctx,
        &batch_specs::<Devices>(ctx, batch, layers, sampler, round)?,
    )
}

/// Work and memory of one epoch of CoB or MB.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize)]
pub struct EpochStats {
    /// "cob" or "mb".
    pub mode: String,
    pub sampler: String,
    pub batch_size: usize,
    pub iterations: usize,
    /// MFGs built (iterations for CoB: one per server per iteration is one plan; iterations
    /// x devices for MB).
    pub mfgs: usize,
    pub targets: u64,
    pub computed_vertices_per_layer: Vec<u64>,
    pub computed_vertex_layers: u64,
    pub aggregated_edges_per_layer: Vec<u64>,
    /// Σ over iterations of the one-hop graphs' edges.
    pub sampled_edges: u64,
    /// Largest per-device memory estimate over the epoch (0 without model dims).
    pub peak_bytes: u64,
}

fn finish(mut s: EpochStats) -> EpochStats {
    s.computed_vertex_layers = s.computed_vertices_per_layer.iter().sum();
    s
}

fn empty(mode: &str, sampler: &dyn Sampler, batch_size: usize, iterations: usize) -> EpochStats {
    EpochStats {
        mode: mode.into(),
        sampler: sampler.name(),
        batch_size,
        iterations,
        mfgs: 0,
        targets: 0,
        computed_vertices_per_layer: Vec::new(),
        computed_vertex_layers: 0,
        aggregated_edges_per_layer: Vec::new(),
        sampled_edges: 0,
        peak_bytes: 0,
    }
}

impl EpochStats {
    /// Adds what the device plans of one iteration compute.
    fn count<'a>(&mut self, devices: impl IntoIterator<Item = &'a DevicePlan>) {
        for d in devices {
            let (c, e) = device_counts(d);
            add(&mut self.computed_vertices_per_layer, &c);
            add(&mut self.aggregated_edges_per_layer, &e);
            self.sampled_edges += d.num_edges() as u64;
        }
    }
}

/// Runs `iteration` (stats, batches, round) on every iteration of `epoch`, counting the
/// batches' targets, with progress labelled by `mode`.
fn epoch_stats<G: Grouping>(
    mode: &str,
    batcher: &Batcher<G>,
    sampler: &dyn Sampler,
    epoch: u64,
    mut iteration: impl FnMut(&mut EpochStats, &[Vec<u32>], u64) -> Result<()>,
) -> Result<EpochStats> {
    let n = batcher.iterations();
    let mut s = empty(mode, sampler, batcher.batch_size(), n);
    let mut progress = grandis_telemetry::Progress::new(format!("{mode} epoch"), Some(n as u64));
    for it in 0..n {
        let batch = batcher.batch(epoch, it)?;
        s.targets += batch.iter().map(|b| b.len() as u64).sum::<u64>();
        iteration(&mut s, &batch, round_of(epoch, it, n))?;
        progress.inc(1);
    }
    progress.finish();
    Ok(finish(s))
}

/// Builds every CoB plan of `epoch` and counts (plans are dropped after counting).
pub fn cob_epoch_stats(
    ctx: &PlanContext<'_>,
    batcher: &CoBatcher,
    layers: usize,
    sampler: &dyn Sampler,
    dims: Option<&ModelDims>,
    epoch: u64,
) -> Result<EpochStats> {
    epoch_stats("cob", batcher, sampler, epoch, |s, batch, round| {
        let plan = cob_plan(ctx, batch, layers, sampler, round)?;
        s.mfgs += 1;
        s.count(&plan.devices);
        if let Some(dims) = dims {
            s.peak_bytes = s.peak_bytes.max(estimate_masked(dims, &plan).max_bytes);
        }
        Ok(())
    })
}

/// Builds every MB plan of `epoch` and counts.
pub fn mb_epoch_stats(
    ctx: &PlanContext<'_>,
    batcher: &MiniBatcher,
    layers: usize,
    sampler: &dyn Sampler,
    dims: Option<&ModelDims>,
    epoch: u64,
) -> Result<EpochStats> {
    epoch_stats("mb", batcher, sampler, epoch, |s, batch, round| {
        let plans = mb_plans(ctx, batch, layers, sampler, round)?;
        s.mfgs += plans.len();
        s.count(&plans);
        if let Some(dims) = dims {
            for d in &plans {
                s.peak_bytes = s.peak_bytes.max(estimate_masked_device(dims, d).total);
            }
        }
        Ok(())
    })
}
