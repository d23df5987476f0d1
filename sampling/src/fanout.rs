//! Layer-wise fanout sampling (GraphSAGE, as DGL/PyG/SALIENT++ do it), expressed as per-layer
//! edge masks over one one-hop graph.
//!
//! `fanouts[i]` is the fanout of hop `i + 1` from the targets (PyG's `num_neighbors` order:
//! `25,10,5` gives every target 25 in-neighbours at the LAST layer). Hop d (d = 1..=L) feeds
//! layer `L - d`: every vertex whose level is `<= d - 1` (all rows valid at that layer, targets
//! included, exactly like the destination set of a DGL block) draws `min(fanouts[d-1],
//! in-degree)` of its in-neighbours uniformly without replacement, independently per layer;
//! the sources first reached in hop d get level d. The draw of (vertex, layer) depends only
//! on (seed, round, vertex, layer): Floyd's algorithm picks neighbour positions from a
//! counter-based stream keyed by those four, so no generator is seeded per row, nothing is
//! allocated per row, and the step is the same whatever the number of threads. The result is
//! one CSR with a layer bit per edge, in the sample's own vertex numbers, level by level as a
//! plan orders its rows ([`SampledEdges::from_blocks`]), so the plan's one-hop graph
//! is the union over layers and `DevicePlan::layer_graphs[l]` holds layer l's edges: a runner
//! aggregates layer l over `layer_graph(l)` and divides by `agg_degree_at(l, row)` (the
//! per-layer kept count).
//!
//! With [`RelationFanouts`] (a typed graph, `relation_fanouts`), a vertex draws the
//! in-neighbours of each relation into its type on their own, that relation's fanout of them:
//! a typed graph has at most one relation per ordered pair of types, so a neighbour's type
//! names the relation of its edge.

use grandis_masking::{Edges, ExtractionSpec, PlanContext, SampledEdges};
use grandis_store::csr::{concat_parts, row_runs, CsrGraph};
use rayon::prelude::*;

use crate::error::{Result, SamplingError};
use crate::numbering::Numbering;
use crate::rng::{below, counter, mix};
use crate::sampler::{check_seeds, Sampler};

/// How many rows or edges ahead a walk over scattered ids prefetches: enough to overlap a
/// dozen cache misses, few enough that the lines are still cached when used.
const PREFETCH_AHEAD: usize = 8;

/// GraphSAGE layer-wise neighbour sampling.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Fanout {
    /// Per hop from the targets (hop 1 first).
    pub fanouts: Vec<usize>,
    pub seed: u64,
    /// Per-relation fanouts on a typed graph (None: one draw over all in-neighbours).
    pub relations: Option<std::sync::Arc<RelationFanouts>>,
}

/// The fanout of every relation of a typed graph, per hop ([`Fanout::with_relations`]).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RelationFanouts {
    /// Each vertex's type, by the plan's vertex ids.
    pub vertex_types: Vec<u16>,
    /// How many types there are.
    pub types: usize,
    /// Per hop from the targets (hop 1 first), per `dst_type * types + src_type`: how many
    /// in-neighbours of the source type a vertex of the destination type draws (0 where no
    /// relation joins the two types, whose edges a typed graph does not have).
    pub fanouts: Vec<Vec<usize>>,
}

impl RelationFanouts {
    /// The most sources one vertex draws at hop `hop` (0-based): the largest sum of a
    /// destination type's fanouts.
    fn most_per_vertex(&self, hop: usize) -> usize {
        self.fanouts[hop]
            .chunks(self.types.max(1))
            .map(|row| row.iter().sum::<usize>())
            .max()
            .unwrap_or(0)
    }
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
        Ok(Fanout {
            fanouts,
            seed,
            relations: None,
        })
    }

    /// This sampler drawing each relation's in-neighbours on their own, `relations`'
    /// fanouts of them (one table per hop, as many hops as `fanouts`).
    pub fn with_relations(self, relations: RelationFanouts) -> Result<Fanout> {
        let t = relations.types;
        let config = |m: String| Err(SamplingError::Config(format!("relation fanouts: {m}")));
        if relations.fanouts.len() != self.fanouts.len() {
            return config(format!(
                "{} hops given, the sampler has {}",
                relations.fanouts.len(),
                self.fanouts.len()
            ));
        }
        if relations.fanouts.iter().any(|hop| hop.len() != t * t) {
            return config(format!("every hop needs a {t} x {t} table of fanouts"));
        }
        if let Some(v) = relations
            .vertex_types
            .iter()
            .position(|&ty| ty as usize >= t)
        {
            return config(format!("vertex {v} has a type outside the {t} types"));
        }
        Ok(Fanout {
            relations: Some(std::sync::Arc::new(relations)),
            ..self
        })
    }

    /// The most sources one vertex draws at hop `hop` (0-based).
    fn most_per_vertex(&self, hop: usize) -> usize {
        match &self.relations {
            Some(r) => r.most_per_vertex(hop),
            None => self.fanouts[hop],
        }
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

    /// The sampled in-neighbours of `v` for `layer` in `round`, appended to `out`, distinct,
    /// in the order drawn (a step renumbers and sorts every row anyway, so sorting here would
    /// be paid twice; [`Fanout::sample_row`] gives them sorted).
    pub fn sample_row_into(
        &self,
        ctx: &PlanContext<'_>,
        v: u32,
        layer: usize,
        fanout: usize,
        round: u64,
        out: &mut Vec<u32>,
    ) {
        let nbrs = ctx.in_neighbors(v);
        let n = nbrs.len();
        if n <= fanout {
            out.extend_from_slice(nbrs);
            return;
        }
        let key = mix(&[self.seed, round, v as u64, layer as u64, 0x5A6E]);
        let start = out.len();
        draw_positions(key, n, fanout, out);
        for p in &mut out[start..] {
            *p = nbrs[*p as usize];
        }
    }

    /// [`Fanout::sample_row_into`] by relation: for each source type, `v`'s in-neighbours of
    /// that type, its relation's fanout of them at hop `hop` (0-based), drawn from a stream
    /// of its own. `scratch` holds one type's positions at a time.
    #[allow(clippy::too_many_arguments)]
    fn sample_typed_row_into(
        &self,
        relations: &RelationFanouts,
        ctx: &PlanContext<'_>,
        v: u32,
        layer: usize,
        hop: usize,
        round: u64,
        out: &mut Vec<u32>,
        scratch: &mut Vec<u32>,
    ) {
        let nbrs = ctx.in_neighbors(v);
        let t = relations.types;
        let dst = relations.vertex_types[v as usize] as usize;
        let row = &relations.fanouts[hop][dst * t..(dst + 1) * t];
        for (src, &fanout) in row.iter().enumerate().filter(|(_, &f)| f > 0) {
            scratch.clear();
            scratch
                .extend((0..nbrs.len() as u32).filter(|&i| {
                    relations.vertex_types[nbrs[i as usize] as usize] as usize == src
                }));
            let n = scratch.len();
            if n <= fanout {
                out.extend(scratch.iter().map(|&i| nbrs[i as usize]));
                continue;
            }
            let key = mix(&[
                self.seed,
                round,
                v as u64,
                layer as u64,
                0x5A6E,
                1 + src as u64,
            ]);
            let start = out.len();
            draw_positions(key, n, fanout, out);
            for p in &mut out[start..] {
                *p = nbrs[scratch[*p as usize] as usize];
            }
        }
    }

    /// [`Fanout::sample_row_into`] into a new vector, ascending.
    pub fn sample_row(
        &self,
        ctx: &PlanContext<'_>,
        v: u32,
        layer: usize,
        fanout: usize,
        round: u64,
    ) -> Vec<u32> {
        let mut out = Vec::with_capacity(fanout.min(ctx.in_neighbors(v).len()));
        self.sample_row_into(ctx, v, layer, fanout, round, &mut out);
        out.sort_unstable();
        out
    }

    /// Draws of `layer` for every vertex of `frontier`, as a CSR in frontier order (chunks
    /// drawn in parallel and joined in order, so the result does not depend on threads).
    fn draw_hop(
        &self,
        ctx: &PlanContext<'_>,
        frontier: &[u32],
        layer: usize,
        hop: usize,
        round: u64,
    ) -> CsrGraph {
        let fanout = self.most_per_vertex(hop);
        const CHUNK: usize = 2048;
        let parts: Vec<CsrGraph> = row_runs(frontier.len(), CHUNK)
            .into_par_iter()
            .map(|run| {
                let chunk = &frontier[run];
                let mut offsets = Vec::with_capacity(chunk.len() + 1);
                offsets.push(0u64);
                let mut srcs = Vec::with_capacity(chunk.len() * fanout);
                let mut scratch = Vec::new();
                let graph = ctx.graph();
                for (i, &v) in chunk.iter().enumerate() {
                    // Rows at scattered ids: their offsets two windows ahead, the start of
                    // their sources one window ahead (offsets in cache by then).
                    if let Some(&w) = chunk.get(i + 2 * PREFETCH_AHEAD) {
                        graph.prefetch_offsets(w);
                    }
                    if let Some(&w) = chunk.get(i + PREFETCH_AHEAD) {
                        graph.prefetch_row_lines(w, 4);
                    }
                    match &self.relations {
                        Some(r) => self.sample_typed_row_into(
                            r,
                            ctx,
                            v,
                            layer,
                            hop,
                            round,
                            &mut srcs,
                            &mut scratch,
                        ),
                        None => self.sample_row_into(ctx, v, layer, fanout, round, &mut srcs),
                    }
                    offsets.push(srcs.len() as u64);
                }
                CsrGraph {
                    offsets,
                    indices: srcs,
                }
            })
            .collect();
        CsrGraph::join(parts)
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
        check_seeds(ctx, server, &targets)?;
        // The sample's vertices, numbered as the plan orders its rows: level by level (the hop
        // that first reached a vertex; the targets are level 0), by global id within a level.
        // Hop d draws for every vertex of levels < d, which are then the prefix numbered
        // before it. Maps are sized to the sample, never to the graph.
        let mut vertices: Vec<u32> = targets.clone();
        let bound = (0..hops)
            .map(|hop| self.most_per_vertex(hop))
            .scan(targets.len(), |frontier, f| {
                *frontier = frontier.saturating_mul(f + 1);
                Some(*frontier)
            })
            .last()
            .unwrap_or(targets.len());
        let mut numbering = Numbering::new(bound.min(ctx.num_vertices()), ctx.num_vertices());
        numbering.number_targets(&targets);
        // Per hop: (rows drawn, CSR offsets, sources as sample numbers) in sample order.
        let mut draws: Vec<(usize, Vec<u64>, Vec<u32>)> = Vec::with_capacity(hops);
        // Where each level starts in `vertices`: what the plan reads instead of re-deriving
        // the levels from the edges.
        let mut level_starts = vec![0, vertices.len()];
        for d in 1..=hops {
            let frontier = vertices.len();
            let CsrGraph {
                offsets,
                indices: mut srcs,
            } = self.draw_hop(ctx, &vertices[..frontier], hops - d, d - 1, round);
            let level = numbering.number_hop(&mut srcs, frontier as u32);
            vertices.extend_from_slice(&level);
            level_starts.push(vertices.len());
            draws.push((frontier, offsets, srcs));
        }
        // One CSR over the rows (every vertex drawn for by the last hop), in sample order; a
        // row's edges are the union of its draws, each with the bits of the layers drawing it.
        // Runs of rows on the thread pool, joined in row order.
        let rows_n = draws.last().map_or(0, |h| h.0);
        let merge = |rows: std::ops::Range<usize>| {
            let mut offsets = Vec::with_capacity(rows.len() + 1);
            offsets.push(0u64);
            let mut sources: Vec<u32> = Vec::new();
            let mut bits: Vec<u64> = Vec::new();
            let mut merged: Vec<(u32, u64)> = Vec::new();
            for i in rows {
                // Drawn by one hop alone (the last level before the leaves, most rows): its
                // sources are distinct, only their order to settle.
                let mut by = draws.iter().enumerate().filter(|(_, h)| i < h.0);
                if let (Some((d, (_, off, srcs))), None) = (by.next(), by.next()) {
                    let start = sources.len();
                    sources.extend_from_slice(&srcs[off[i] as usize..off[i + 1] as usize]);
                    sources[start..].sort_unstable();
                    bits.resize(sources.len(), 1u64 << (hops - 1 - d));
                    offsets.push(sources.len() as u64);
                    continue;
                }
                merged.clear();
                for (d, (drawn, off, srcs)) in draws.iter().enumerate() {
                    if i < *drawn {
                        let layer = hops - 1 - d;
                        let row = &srcs[off[i] as usize..off[i + 1] as usize];
                        merged.extend(row.iter().map(|&u| (u, 1u64 << layer)));
                    }
                }
                SampledEdges::append_row(&mut merged, &mut sources, &mut bits);
                offsets.push(sources.len() as u64);
            }
            (
                CsrGraph {
                    offsets,
                    indices: sources,
                },
                bits,
            )
        };
        const ROWS_PER_TASK: usize = 8192;
        let (rows, bits): (Vec<CsrGraph>, Vec<Vec<u64>>) = row_runs(rows_n, ROWS_PER_TASK)
            .into_par_iter()
            .map(merge)
            .unzip();
        let CsrGraph {
            offsets,
            indices: sources,
        } = CsrGraph::join(rows);
        let bits = concat_parts(bits);
        Ok(ExtractionSpec {
            server,
            targets,
            hops,
            edges: Edges::Sampled(
                SampledEdges::from_blocks(vertices, rows_n, offsets, sources, Some((hops, bits)))?
                    .with_levels(level_starts)?,
            ),
        })
    }

    fn name(&self) -> String {
        let f: Vec<String> = self.fanouts.iter().map(usize::to_string).collect();
        let by = if self.relations.is_some() {
            ", per relation"
        } else {
            ""
        };
        format!("sage({}{by})", f.join(","))
    }
}

/// Floyd's algorithm: `fanout` distinct positions in `0..n` (`fanout < n`), every subset
/// equally likely, from the counter-based stream `key`, appended to `out`: for `j` in
/// `n - fanout .. n` pick `t` uniform in `0..=j`, take `t` unless taken, else `j`.
fn draw_positions(key: u64, n: usize, fanout: usize, out: &mut Vec<u32>) {
    let start = out.len();
    // A linear scan of the picks is fastest for the fanouts GNNs use; a set past that.
    let mut taken: Option<rustc_hash::FxHashSet<u32>> =
        (fanout > 64).then(rustc_hash::FxHashSet::default);
    for j in (n - fanout)..n {
        let t = below(counter(key, j as u64), j as u64 + 1) as u32;
        let clash = match &mut taken {
            Some(set) => !set.insert(t),
            None => out[start..].contains(&t),
        };
        let take = if clash { j as u32 } else { t };
        if clash {
            if let Some(set) = &mut taken {
                set.insert(take);
            }
        }
        out.push(take);
    }
}
