//! GraphSAINT subgraph sampling, server-wise (GraNNDIS §5.2: subgraph samplers are "the
//! unmasked version of one-hop graph masking" when extended to a server): per iteration each
//! server samples a vertex subset of ITS OWN vertices; the subset is the target set and the
//! one-hop graph is the subgraph it induces, so every level is 0 and no row is ever masked.
//!
//! Normalisation: plain mean over the kept (induced) in-neighbours — the plan's
//! `DevicePlan::agg_degree` — and an unweighted loss over the sampled training vertices. We do
//! NOT apply GraphSAINT's pre-sampled aggregator/loss normalisation coefficients (alpha,
//! lambda); that is a documented simplification.

use grandis_masking::{Edges, ExtractionSpec, PlanContext, SampledEdges};
use rand::distributions::{Distribution, WeightedIndex};
use rand::Rng;

use crate::error::{Result, SamplingError};
use crate::rng::rng;

/// Which GraphSAINT sampler.
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize)]
pub enum SaintKind {
    /// `budget` draws (with replacement, duplicates merged) with probability proportional to
    /// in-degree + 1 (GraphSAINT's node sampler weighs by the squared column norm of the
    /// normalised adjacency, which is proportional to the degree for mean aggregation).
    Node { budget: usize },
    /// `roots` uniform roots, each walking `length` steps to a uniform in-neighbour inside the
    /// server (a walk stops early at a vertex with none).
    RandomWalk { roots: usize, length: usize },
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize)]
pub struct Saint {
    pub kind: SaintKind,
    pub seed: u64,
}

impl Saint {
    /// The sampled vertex subset of `server` in `round` (sorted, distinct).
    pub fn sample_vertices(
        &self,
        ctx: &PlanContext<'_>,
        server: usize,
        round: u64,
    ) -> Result<Vec<u32>> {
        let layout = ctx.layout();
        if server >= layout.servers() {
            return Err(SamplingError::Config(format!(
                "server {server} does not exist (the layout has {})",
                layout.servers()
            )));
        }
        let range = layout.server_range(server);
        if range.is_empty() {
            return Ok(Vec::new());
        }
        let mut r = rng(&[self.seed, round, server as u64, 0x5A1]);
        let mut out: Vec<u32> = match self.kind {
            SaintKind::Node { budget } => {
                let weights: Vec<u64> =
                    range.clone().map(|v| ctx.in_degree(v) as u64 + 1).collect();
                let dist = WeightedIndex::new(&weights).map_err(|e| {
                    SamplingError::Config(format!("node sampler weights of server {server}: {e}"))
                })?;
                (0..budget)
                    .map(|_| range.start + dist.sample(&mut r) as u32)
                    .collect()
            }
            SaintKind::RandomWalk { roots, length } => {
                let mut out = Vec::with_capacity(roots * (length + 1));
                for _ in 0..roots {
                    let mut v = r.gen_range(range.clone());
                    out.push(v);
                    for _ in 0..length {
                        let nb = ctx.in_neighbors(v);
                        // Inner in-neighbours are a contiguous slice of the sorted row.
                        let lo = nb.partition_point(|&u| u < range.start);
                        let hi = nb.partition_point(|&u| u < range.end);
                        if lo == hi {
                            break;
                        }
                        v = nb[r.gen_range(lo..hi)];
                        out.push(v);
                    }
                }
                out
            }
        };
        out.sort_unstable();
        out.dedup();
        Ok(out)
    }

    /// The spec of `server` in `round`: targets = the sample, kept edges = the induced
    /// subgraph, `hops` masked layers (all rows valid at every layer).
    pub fn spec(
        &self,
        ctx: &PlanContext<'_>,
        server: usize,
        hops: usize,
        round: u64,
    ) -> Result<ExtractionSpec> {
        let targets = self.sample_vertices(ctx, server, round)?;
        let rows = targets.iter().map(|&v| {
            let kept = ctx
                .in_neighbors(v)
                .iter()
                .copied()
                .filter(|u| targets.binary_search(u).is_ok())
                .collect();
            (v, kept)
        });
        let edges = Edges::Sampled(SampledEdges::from_rows(rows.collect::<Vec<_>>())?);
        Ok(ExtractionSpec {
            server,
            targets,
            hops,
            edges,
        })
    }

    /// Every server's spec for `round`, as one masked plan.
    pub fn plan(
        &self,
        ctx: &PlanContext<'_>,
        hops: usize,
        round: u64,
    ) -> Result<grandis_masking::FlxPlan> {
        let specs = (0..ctx.layout().servers())
            .map(|s| self.spec(ctx, s, hops, round))
            .collect::<Result<Vec<_>>>()?;
        Ok(ctx.extract_plan(&specs)?)
    }
}
