//! Layer-wise fanout sampling (GraphSAGE, as DGL/PyG/SALIENT++ do it), expressed as per-layer
//! edge masks over one one-hop graph.
//!
//! `fanouts[i]` is the fanout of hop `i + 1` from the targets (PyG's `num_neighbors` order:
//! `25,10,5` gives every target 25 in-neighbours at the LAST layer). Hop d (d = 1..=L) feeds
//! layer `L - d`: every vertex whose level is `<= d - 1` (all rows valid at that layer, targets
//! included, exactly like the destination set of a DGL block) draws `min(fanouts[d-1],
//! in-degree)` of its in-neighbours uniformly without replacement, independently per layer;
//! the sources first reached in hop d get level d. The sample of (vertex, layer) depends only
//! on (seed, round, vertex, layer). The result is [`SampledEdges::from_layer_rows`], so the
//! plan's one-hop graph is the union over layers and `DevicePlan::layer_graphs[l]` holds layer
//! l's edges: a runner aggregates layer l over `layer_graph(l)` and divides by
//! `agg_degree_at(l, row)` (the per-layer kept count).

use grandis_masking::{Edges, ExtractionSpec, PlanContext, SampledEdges};
use rand::seq::index;

use crate::error::{Result, SamplingError};
use crate::rng::rng;
use crate::sampler::{check_targets, Sampler};

/// GraphSAGE layer-wise neighbour sampling.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Fanout {
    /// Per hop from the targets (hop 1 first).
    pub fanouts: Vec<usize>,
    pub seed: u64,
}

impl Fanout {
    pub fn new(fanouts: Vec<usize>, seed: u64) -> Result<Fanout> {
        if fanouts.is_empty() {
            return Err(SamplingError::Config(
                "fanouts: give one fanout per layer (e.g. 25,10,5)".into(),
            ));
        }
        if let Some(i) = fanouts.iter().position(|&f| f == 0) {
            return Err(SamplingError::Config(format!(
                "fanouts: hop {} has fanout 0; every hop needs at least 1",
                i + 1
            )));
        }
        Ok(Fanout { fanouts, seed })
    }

    /// Parses `"25,10,5"`.
    pub fn parse(s: &str, seed: u64) -> Result<Fanout> {
        let fanouts = s
            .split(',')
            .map(|p| {
                p.trim().parse::<usize>().map_err(|_| {
                    SamplingError::Config(format!(
                        "fanouts: {p:?} in {s:?} is not a non-negative integer"
                    ))
                })
            })
            .collect::<Result<Vec<_>>>()?;
        Fanout::new(fanouts, seed)
    }

    /// The sampled in-neighbours of `v` for `layer` in `round` (sorted).
    pub fn sample_row(
        &self,
        ctx: &PlanContext<'_>,
        v: u32,
        layer: usize,
        fanout: usize,
        round: u64,
    ) -> Vec<u32> {
        let nbrs = ctx.in_neighbors(v);
        if nbrs.len() <= fanout {
            return nbrs.to_vec();
        }
        let mut r = rng(&[self.seed, round, v as u64, layer as u64, 0x5A6E]);
        let mut out: Vec<u32> = index::sample(&mut r, nbrs.len(), fanout)
            .into_iter()
            .map(|i| nbrs[i])
            .collect();
        out.sort_unstable();
        out
    }
}

impl Sampler for Fanout {
    fn spec(
        &self,
        ctx: &PlanContext<'_>,
        server: usize,
        targets: Vec<u32>,
        hops: usize,
        round: u64,
    ) -> Result<ExtractionSpec> {
        if hops != self.fanouts.len() {
            return Err(SamplingError::Config(format!(
                "fanouts: {} given for a {hops}-layer model; give one per layer",
                self.fanouts.len()
            )));
        }
        check_targets(ctx, server, &targets)?;
        let n = ctx.num_vertices();
        let mut reached = vec![false; n];
        let mut valid: Vec<u32> = targets.clone();
        for &t in &targets {
            if let Some(slot) = reached.get_mut(t as usize) {
                *slot = true;
            }
        }
        let mut per_layer: Vec<Vec<(u32, Vec<u32>)>> = vec![Vec::new(); hops];
        for d in 1..=hops {
            let layer = hops - d;
            let fanout = self.fanouts[d - 1];
            let rows: Vec<(u32, Vec<u32>)> = {
                use rayon::prelude::*;
                valid
                    .par_iter()
                    .map(|&v| (v, self.sample_row(ctx, v, layer, fanout, round)))
                    .collect()
            };
            for (_, srcs) in &rows {
                for &u in srcs {
                    if !reached[u as usize] {
                        reached[u as usize] = true;
                        valid.push(u);
                    }
                }
            }
            per_layer[layer] = rows;
        }
        Ok(ExtractionSpec {
            server,
            targets,
            hops,
            edges: Edges::Sampled(SampledEdges::from_layer_rows(per_layer)?),
        })
    }

    fn name(&self) -> String {
        let f: Vec<String> = self.fanouts.iter().map(usize::to_string).collect();
        format!("sage({})", f.join(","))
    }
}
