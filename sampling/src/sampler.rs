//! The interface every dependency sampler implements, and the exact (unsampled) one.

use grandis_masking::{ExtractionSpec, PlanContext};

use crate::error::Result;

/// Turns a server's targets into an extraction spec ([`ExtractionSpec`]) over `hops` hops.
///
/// `round` keys the randomness: the same (seed, round) gives the same spec, a new round a new
/// sample. Cooperative batching uses one round per iteration ([`crate::round_of`]); FLX-EAS
/// one per resampling period ([`crate::round_for_epoch`]).
pub trait Sampler: Sync {
    fn spec(
        &self,
        ctx: &PlanContext<'_>,
        server: usize,
        targets: Vec<u32>,
        hops: usize,
        round: u64,
    ) -> Result<ExtractionSpec>;
    /// Short name for logs and summaries ("exact", "eas(h=1,f=15,degree)", "sage(25,10,5)").
    fn name(&self) -> String;
}

/// No sampling: the exact `hops`-hop in-closure of the targets.
#[derive(Debug, Clone, Copy, Default)]
pub struct Exact;

impl Sampler for Exact {
    fn spec(
        &self,
        _ctx: &PlanContext<'_>,
        server: usize,
        targets: Vec<u32>,
        hops: usize,
        _round: u64,
    ) -> Result<ExtractionSpec> {
        Ok(ExtractionSpec::exact(server, targets, hops))
    }
    fn name(&self) -> String {
        "exact".into()
    }
}

/// The sampling round of `epoch` when resampling every `every` epochs (`None` or 0: sample
/// once, round 0 for every epoch). This is what `--resample-every N` maps to.
pub fn round_for_epoch(epoch: u64, every: Option<u64>) -> u64 {
    match every {
        Some(n) if n > 0 => epoch / n,
        _ => 0,
    }
}

/// The sampling round of iteration `iteration` of `epoch` when an epoch has `iterations`
/// iterations (one fresh sample per co-batch).
pub fn round_of(epoch: u64, iteration: usize, iterations: usize) -> u64 {
    epoch * iterations as u64 + iteration as u64
}

/// Targets must be sorted, distinct and owned by `server` (checked before a sampler reads
/// the graph at them, so a bad id is an error, never a panic): what a sampler that trims at
/// its server's boundary (EAS) needs.
pub(crate) fn check_targets(ctx: &PlanContext<'_>, server: usize, targets: &[u32]) -> Result<()> {
    check_seeds(ctx, server, targets)?;
    let range = ctx.layout().server_range(server);
    if let Some(t) = targets.iter().find(|t| !range.contains(t)) {
        return Err(crate::SamplingError::Config(format!(
            "server {server}: target {t} is not one of its vertices ({}..{})",
            range.start, range.end
        )));
    }
    Ok(())
}

/// Targets must be sorted, distinct vertices of the graph, `server` one of the layout's: what
/// a sampler that reads only the graph needs (a mini-batch seeded by edges has targets on
/// every server: masking checks ownership where a plan places targets by it).
pub(crate) fn check_seeds(ctx: &PlanContext<'_>, server: usize, targets: &[u32]) -> Result<()> {
    let layout = ctx.layout();
    if server >= layout.servers() {
        return Err(crate::SamplingError::Config(format!(
            "server {server} does not exist (the layout has {})",
            layout.servers()
        )));
    }
    if let Some(w) = targets.windows(2).find(|w| w[0] >= w[1]) {
        return Err(crate::SamplingError::Config(format!(
            "server {server}: targets must be sorted and distinct ({} then {})",
            w[0], w[1]
        )));
    }
    let n = ctx.num_vertices();
    if let Some(t) = targets.iter().find(|&&t| t as usize >= n) {
        return Err(crate::SamplingError::Config(format!(
            "server {server}: target {t} is not a vertex (the graph has {n})"
        )));
    }
    Ok(())
}
