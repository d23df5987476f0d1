//! GraphTheta's cluster batches (`--mode cluster`; `graphtheta.txt`, the cluster-batch
//! strategy, as in Cluster-GCN): the graph is cut into small clusters (a finer METIS level
//! inside each server, computed by the caller), and each iteration trains on a union of
//! clusters with every vertex's neighbours restricted to the batch: a full convolution on the
//! subgraph the batch induces, every layer on every batch vertex, and no sampled neighbourhood
//! reaching outside it.
//!
//! Each server shuffles its own clusters every epoch and every iteration takes the next
//! `clusters_per_batch` of them, so every server has work in every iteration and an epoch
//! visits every cluster (a server with fewer clusters than the busiest one wraps around and
//! revisits some). A batch vertex's in-neighbours in another server's clusters of the same
//! batch stay in (they are replicated like any co-batch dependency), which is what makes it a
//! union of clusters rather than a set of per-server batches.

use grandis_masking::{Edges, ExtractionSpec, FlxPlan, PlanContext, SampledEdges};
use rand::seq::SliceRandom;

use crate::error::{Result, SamplingError};
use crate::rng::rng;

/// The clusters of every server and how iterations draw them.
#[derive(Debug, Clone)]
pub struct ClusterBatches {
    /// `clusters[server][c]`: the vertices of cluster `c` of the server (sorted, non-empty).
    clusters: Vec<Vec<Vec<u32>>>,
    per_batch: usize,
    iterations: usize,
    seed: u64,
}

impl ClusterBatches {
    /// Clusters from `cluster_of` (every vertex's cluster within its server, numbered from 0;
    /// empty cluster numbers are skipped), `per_batch` of them per server per iteration.
    pub fn new(
        ctx: &PlanContext<'_>,
        cluster_of: &[u32],
        per_batch: usize,
        seed: u64,
    ) -> Result<ClusterBatches> {
        let layout = ctx.layout();
        if cluster_of.len() != ctx.num_vertices() {
            return Err(SamplingError::Config(format!(
                "{} cluster ids for {} vertices",
                cluster_of.len(),
                ctx.num_vertices()
            )));
        }
        if per_batch == 0 {
            return Err(SamplingError::Config(
                "a cluster batch needs at least one cluster per server".into(),
            ));
        }
        let clusters: Vec<Vec<Vec<u32>>> = (0..layout.servers())
            .map(|s| {
                let range = layout.server_range(s);
                let count = range
                    .clone()
                    .map(|v| cluster_of[v as usize] as usize + 1)
                    .max()
                    .unwrap_or(0);
                let mut out = vec![Vec::new(); count];
                for v in range {
                    out[cluster_of[v as usize] as usize].push(v);
                }
                out.retain(|c| !c.is_empty());
                out
            })
            .collect();
        let iterations = clusters
            .iter()
            .map(|c| c.len().div_ceil(per_batch))
            .max()
            .unwrap_or(0);
        Ok(ClusterBatches {
            clusters,
            per_batch,
            iterations,
            seed,
        })
    }

    /// Iterations per epoch: enough for the server with the most clusters to visit each.
    pub fn iterations(&self) -> usize {
        self.iterations
    }

    /// Clusters of every server.
    pub fn clusters(&self) -> Vec<usize> {
        self.clusters.iter().map(Vec::len).collect()
    }

    /// "cluster(q=8 of 40)": clusters per batch, clusters in all.
    pub fn name(&self) -> String {
        format!(
            "cluster(q={} of {})",
            self.per_batch,
            self.clusters.iter().map(Vec::len).sum::<usize>()
        )
    }

    /// The batch of `iteration` in `epoch` (0-based): every server's vertices (sorted).
    pub fn batch(&self, epoch: u64, iteration: usize) -> Result<Vec<Vec<u32>>> {
        if iteration >= self.iterations {
            return Err(SamplingError::Config(format!(
                "iteration {iteration} of an epoch of {}",
                self.iterations
            )));
        }
        Ok(self
            .clusters
            .iter()
            .enumerate()
            .map(|(s, clusters)| {
                if clusters.is_empty() {
                    return Vec::new();
                }
                let mut order: Vec<usize> = (0..clusters.len()).collect();
                order.shuffle(&mut rng(&[self.seed, epoch, s as u64, 0xC1]));
                let mut vs: Vec<u32> = (0..self.per_batch.min(clusters.len()))
                    .flat_map(|j| {
                        let c = order[(iteration * self.per_batch + j) % clusters.len()];
                        clusters[c].iter().copied()
                    })
                    .collect();
                vs.sort_unstable();
                vs
            })
            .collect())
    }

    /// The plan of a batch: each server's part of it as targets, every layer computed on
    /// them, edges restricted to the batch (a union over the servers) for `hops` hops.
    pub fn plan(&self, ctx: &PlanContext<'_>, batch: &[Vec<u32>], hops: usize) -> Result<FlxPlan> {
        let mut all: Vec<u32> = batch.iter().flatten().copied().collect();
        all.sort_unstable();
        let inside = |v: u32| all.binary_search(&v).is_ok();
        let edges = SampledEdges::from_rows(all.iter().map(|&v| {
            let kept: Vec<u32> = ctx
                .in_neighbors(v)
                .iter()
                .copied()
                .filter(|&u| inside(u))
                .collect();
            (v, kept)
        }))?;
        let specs: Vec<ExtractionSpec> = batch
            .iter()
            .enumerate()
            .map(|(s, targets)| ExtractionSpec {
                server: s,
                targets: targets.clone(),
                hops,
                edges: Edges::Sampled(edges.clone()),
            })
            .collect();
        Ok(ctx.extract_plan(&specs)?)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use grandis_masking::{Layout, SplitMembership};
    use grandis_store::{CsrGraph, EdgeOptions};

    /// A ring of 12 vertices on 2 servers (6 each), clusters of 2 consecutive vertices.
    fn ring() -> (CsrGraph, Layout, Vec<u32>) {
        let n = 12u32;
        let edges: Vec<(u32, u32)> = (0..n)
            .flat_map(|v| [(v, (v + 1) % n), ((v + 1) % n, v)])
            .collect();
        let g = grandis_store::graph_from_edges(n as u64, edges, EdgeOptions::default()).unwrap();
        let layout = Layout::even(n, 2, 1).unwrap();
        let cluster_of = (0..n).map(|v| (v % 6) / 2).collect();
        (g, layout, cluster_of)
    }

    #[test]
    fn an_epoch_visits_every_cluster_and_edges_stay_inside_the_batch() {
        let (g, layout, cluster_of) = ring();
        let ctx = PlanContext::new(g.view(), layout, SplitMembership::none(12)).unwrap();
        let cb = ClusterBatches::new(&ctx, &cluster_of, 2, 7).unwrap();
        assert_eq!(cb.clusters(), vec![3, 3]);
        assert_eq!(cb.iterations(), 2);
        let mut seen = vec![0; 12];
        for it in 0..cb.iterations() {
            let batch = cb.batch(0, it).unwrap();
            assert_eq!(batch.len(), 2);
            for (s, vs) in batch.iter().enumerate() {
                assert!(vs.iter().all(|&v| ctx.layout().server_of(v) == s));
                for &v in vs {
                    seen[v as usize] += 1;
                }
            }
            let plan = cb.plan(&ctx, &batch, 2).unwrap();
            let all: Vec<u32> = batch.iter().flatten().copied().collect();
            for d in &plan.devices {
                // Every row the device holds is a batch vertex, and every kept edge joins two.
                assert!(d.global_ids.iter().all(|g| all.contains(g)));
                for i in 0..d.n_owned as u32 {
                    for &j in d.row(i) {
                        assert!(all.contains(&d.global_ids[j as usize]));
                    }
                }
            }
        }
        // 3 clusters, 2 per iteration over 2 iterations: one cluster per server is seen twice.
        assert!(seen.iter().all(|&c| (1..=2).contains(&c)), "{seen:?}");
        assert_eq!(seen.iter().sum::<usize>(), 16);
        assert!(cb.batch(0, 2).is_err());
        assert_ne!(
            cb.batch(0, 0).unwrap(),
            cb.batch(1, 0).unwrap(),
            "reshuffled per epoch"
        );
        assert!(ClusterBatches::new(&ctx, &cluster_of, 0, 7).is_err());
        assert!(ClusterBatches::new(&ctx, &cluster_of[1..], 2, 7).is_err());
    }
}
