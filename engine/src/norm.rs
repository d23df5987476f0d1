//! Normalisation vectors of a whole graph, for the single-process case (a partitioned run
//! slices the same vectors by global id, which is what makes it reproduce these numbers).

use crate::block::BlockGraph;
use grandis_store::CsrView;
use rayon::prelude::*;

/// How neighbour rows are combined.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Aggregation {
    /// Mean over in-neighbours (GraphSAGE); isolated vertices get 0.
    Mean,
    /// Plain sum over in-neighbours.
    Sum,
    /// Kipf & Welling: `D^-1/2 (A + I) D^-1/2` with `D` the degree of `A + I`.
    Gcn,
}

/// Scale vectors indexed by GLOBAL vertex id (see [`BlockGraph`] for their meaning).
#[derive(Debug, Clone, PartialEq)]
pub struct GlobalScales {
    pub dst: Vec<f32>,
    pub src: Option<Vec<f32>>,
    pub self_loop: Option<Vec<f32>>,
}

/// Computes the scales of `agg` on the full graph (in-degree = row length).
///
/// For GCN the self-loop of `A + I` is added through `self_loop` (a diagonal term) instead of
/// copying the graph; a vertex whose row already contains itself keeps that edge as its
/// self-loop and gets no extra one, so `A + I` never counts a loop twice.
pub fn global_scales(graph: CsrView<'_>, agg: Aggregation) -> GlobalScales {
    let n = graph.num_vertices();
    match agg {
        Aggregation::Sum => GlobalScales {
            dst: vec![1.0; n],
            src: None,
            self_loop: None,
        },
        Aggregation::Mean => GlobalScales {
            dst: (0..n as u32)
                .into_par_iter()
                .map(|v| {
                    let d = graph.degree(v);
                    if d == 0 {
                        0.0
                    } else {
                        (1.0 / d as f64) as f32
                    }
                })
                .collect(),
            src: None,
            self_loop: None,
        },
        Aggregation::Gcn => {
            let (inv_sqrt, self_w): (Vec<f32>, Vec<f32>) = (0..n as u32)
                .into_par_iter()
                .map(|v| {
                    let has_loop = graph.has_edge(v, v);
                    let deg = graph.degree(v) as f64 + if has_loop { 0.0 } else { 1.0 };
                    let s = 1.0 / deg.sqrt();
                    (s as f32, if has_loop { 0.0 } else { (1.0 / deg) as f32 })
                })
                .unzip();
            GlobalScales {
                dst: inv_sqrt.clone(),
                src: Some(inv_sqrt),
                self_loop: Some(self_w),
            }
        }
    }
}

/// The whole graph as one block (`n_dst = n_src = n`, local id = global id).
pub fn full_block(graph: CsrView<'_>, agg: Aggregation) -> BlockGraph {
    let n = graph.num_vertices();
    let scales = global_scales(graph, agg);
    BlockGraph {
        n_dst: n,
        n_src: n,
        offsets: graph.offsets.to_vec(),
        indices: graph.indices.to_vec(),
        dst_scale: scales.dst,
        src_scale: scales.src,
        self_scale: scales.self_loop,
    }
}

/// The block of destinations `dst_ids` (global ids) reading from sources `src_ids`, where
/// `src_ids` starts with `dst_ids` and then lists every other source their rows need. Scales
/// come from `scales` (global), so aggregating this block equals the full-graph aggregation
/// restricted to `dst_ids`. Returns `None` when a needed source is missing from `src_ids`.
pub fn sub_block(
    graph: CsrView<'_>,
    scales: &GlobalScales,
    dst_ids: &[u32],
    src_ids: &[u32],
) -> Option<BlockGraph> {
    if src_ids.len() < dst_ids.len() || src_ids[..dst_ids.len()] != *dst_ids {
        return None;
    }
    let local: std::collections::HashMap<u32, u32> = src_ids
        .iter()
        .enumerate()
        .map(|(i, &g)| (g, i as u32))
        .collect();
    let mut offsets = Vec::with_capacity(dst_ids.len() + 1);
    offsets.push(0u64);
    let mut indices = Vec::new();
    for &v in dst_ids {
        for &u in graph.neighbors(v) {
            indices.push(*local.get(&u)?);
        }
        offsets.push(indices.len() as u64);
    }
    let pick = |s: &Vec<f32>, ids: &[u32]| ids.iter().map(|&g| s[g as usize]).collect();
    Some(BlockGraph {
        n_dst: dst_ids.len(),
        n_src: src_ids.len(),
        offsets,
        indices,
        dst_scale: pick(&scales.dst, dst_ids),
        src_scale: scales.src.as_ref().map(|s| pick(s, src_ids)),
        self_scale: scales.self_loop.as_ref().map(|s| pick(s, dst_ids)),
    })
}

/// [`sub_block`] for a contiguous range of destinations, fast enough for whole-graph passes
/// (layer-wise inference builds one per block of a hundred million vertices): the sources are
/// `dst` itself, then `halo`, free of duplicates, disjoint from `dst` and holding every
/// in-neighbour of `dst` outside it; `halo_position(u)` says where `u` is in `halo` (callers
/// keep a dense map, or binary-search a sorted halo). Local ids are computed in parallel.
/// Returns `None` when a neighbour is missing from `halo`.
pub fn range_block(
    graph: CsrView<'_>,
    scales: &GlobalScales,
    dst: std::ops::Range<u32>,
    halo: &[u32],
    halo_position: impl Fn(u32) -> Option<usize> + Sync,
) -> Option<BlockGraph> {
    let (lo, hi) = (dst.start as usize, dst.end as usize);
    let n_dst = hi - lo;
    let base = graph.offsets[lo];
    let offsets: Vec<u64> = graph.offsets[lo..=hi].iter().map(|&o| o - base).collect();
    let edges = &graph.indices[base as usize..graph.offsets[hi] as usize];
    let local = |u: u32| -> Option<u32> {
        if dst.contains(&u) {
            Some(u - dst.start)
        } else {
            halo_position(u).map(|i| (n_dst + i) as u32)
        }
    };
    let indices: Vec<u32> = edges
        .par_iter()
        .map(|&u| local(u))
        .collect::<Option<Vec<u32>>>()?;
    let src_scale = scales.src.as_ref().map(|s| {
        let mut v = s[lo..hi].to_vec();
        v.extend(halo.iter().map(|&g| s[g as usize]));
        v
    });
    Some(BlockGraph {
        n_dst,
        n_src: n_dst + halo.len(),
        offsets,
        indices,
        dst_scale: scales.dst[lo..hi].to_vec(),
        src_scale,
        self_scale: scales.self_loop.as_ref().map(|s| s[lo..hi].to_vec()),
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use grandis_store::CsrGraph;

    /// A range block equals the general sub-block over the same sources, for every
    /// aggregation, and a missing halo vertex is `None`.
    #[test]
    fn range_block_equals_sub_block() {
        // 0->{1,4}, 1->{0,2,3}, 2->{2}, 3->{}, 4->{0,1,2,3}
        let g = CsrGraph {
            offsets: vec![0, 2, 5, 6, 6, 10],
            indices: vec![1, 4, 0, 2, 3, 2, 0, 1, 2, 3],
        };
        for agg in [Aggregation::Mean, Aggregation::Sum, Aggregation::Gcn] {
            let scales = global_scales(g.view(), agg);
            let halo = [0u32, 4];
            let at = |h: &'static [u32]| move |u: u32| h.binary_search(&u).ok();
            let fast = range_block(g.view(), &scales, 1..4, &halo, at(&[0, 4])).unwrap();
            let slow = sub_block(g.view(), &scales, &[1, 2, 3], &[1, 2, 3, 0, 4]).unwrap();
            assert_eq!(fast, slow, "{agg:?}");
            assert!(range_block(g.view(), &scales, 1..4, &[4], at(&[4])).is_none());
        }
    }
}

/// A block split for a typed model ([`grandis_store::types`]): per relation, the block of
/// its edges alone with the mean over them; per vertex type, its rows among the block's
/// sources and among its destinations (a prefix of those), ascending, so that a typed layer
/// transforms only the rows a relation reads or writes.
#[derive(Debug, Clone, PartialEq)]
pub struct RelationBlocks {
    pub relations: Vec<BlockGraph>,
    /// Per type: its rows among the `n_src` sources.
    pub src_rows: Vec<Vec<u32>>,
    /// Per type: its rows among the `n_dst` destinations.
    pub dst_rows: Vec<Vec<u32>>,
}

/// Splits `block` by relation, given the type of each of its `n_src` rows (the
/// destinations are the first `n_dst`). A relation block's mean divides by the row's edges
/// of that relation in `block`: in a block whose rows hold all their edges (every exact
/// plan) that is the relation's global in-degree, so a partitioned run equals the whole
/// graph; a sampled row averages what it kept, as [`BlockGraph`]'s users expect. Fails on an
/// edge whose ends' types no relation joins (a dataset that was not verified).
pub fn relation_blocks(
    block: &BlockGraph,
    types: &grandis_store::Types,
    row_types: &[u16],
) -> crate::error::Result<RelationBlocks> {
    use crate::error::EngineError;
    if row_types.len() != block.n_src {
        return Err(EngineError::Graph(format!(
            "{} row types for a block of {} source rows",
            row_types.len(),
            block.n_src
        )));
    }
    let (relations, n) = (types.num_relations(), block.n_dst);
    let mut offsets = vec![Vec::with_capacity(n + 1); relations];
    let mut indices: Vec<Vec<u32>> = vec![Vec::new(); relations];
    let mut scales = vec![Vec::with_capacity(n); relations];
    for o in &mut offsets {
        o.push(0u64);
    }
    let mut counts = vec![0u64; relations];
    for v in 0..n {
        let dst_type = usize::from(row_types[v]);
        let row = &block.indices[block.offsets[v] as usize..block.offsets[v + 1] as usize];
        counts.iter_mut().for_each(|c| *c = 0);
        for &u in row {
            let src_type = usize::from(row_types[u as usize]);
            let r = types.relation(src_type, dst_type).ok_or_else(|| {
                EngineError::Graph(format!(
                    "an edge joins a {:?} to a {:?}, and no relation does",
                    types.schema.vertex_types[src_type].name,
                    types.schema.vertex_types[dst_type].name
                ))
            })?;
            indices[r].push(u);
            counts[r] += 1;
        }
        for r in 0..relations {
            offsets[r].push(indices[r].len() as u64);
            scales[r].push(match counts[r] {
                0 => 0.0,
                d => (1.0 / d as f64) as f32,
            });
        }
    }
    let relations = offsets
        .into_iter()
        .zip(indices)
        .zip(scales)
        .map(|((offsets, indices), dst_scale)| BlockGraph {
            n_dst: n,
            n_src: block.n_src,
            offsets,
            indices,
            dst_scale,
            src_scale: None,
            self_scale: None,
        })
        .collect();
    let mut src_rows = vec![Vec::new(); types.num_types()];
    for (row, &t) in row_types.iter().enumerate() {
        src_rows[usize::from(t)].push(row as u32);
    }
    let dst_rows = src_rows
        .iter()
        .map(|rows| rows[..rows.partition_point(|&r| (r as usize) < n)].to_vec())
        .collect();
    Ok(RelationBlocks {
        relations,
        src_rows,
        dst_rows,
    })
}
