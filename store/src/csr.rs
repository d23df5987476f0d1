//! Compressed sparse rows (raw edge lists become CSR in `crate::edges`, which also builds
//! small graphs from edge pairs: `CsrGraph::from_edges`).
//!
//! Convention used everywhere in grandis: row `v` lists the *sources* of the edges that end
//! at `v` (its in-neighbours), sorted ascending and without duplicates. A GNN layer computes
//! vertex `v` from exactly this row, so aggregation reads it sequentially. For a symmetric
//! graph in- and out-neighbours coincide.

use rayon::prelude::*;

/// Largest number of vertices a dataset can hold: ids are `u32` and `u32::MAX` is reserved
/// as a "no vertex" sentinel.
pub const MAX_VERTICES: u64 = u32::MAX as u64;

/// A borrowed CSR graph (from an mmap or from a [`CsrGraph`]).
#[derive(Debug, Clone, Copy)]
pub struct CsrView<'a> {
    pub offsets: &'a [u64],
    pub indices: &'a [u32],
}

impl<'a> CsrView<'a> {
    pub fn num_vertices(&self) -> usize {
        self.offsets.len().saturating_sub(1)
    }
    pub fn num_edges(&self) -> usize {
        self.indices.len()
    }
    /// Sources of the edges into `v`.
    pub fn neighbors(&self, v: u32) -> &'a [u32] {
        let v = v as usize;
        &self.indices[self.offsets[v] as usize..self.offsets[v + 1] as usize]
    }
    /// Prefetches the offsets of `v` (the first of the two loads [`CsrView::neighbors`]
    /// makes), for a walk that reads rows at scattered ids a few rows ahead.
    #[inline(always)]
    pub fn prefetch_offsets(&self, v: u32) {
        if let Some(o) = self.offsets.get(v as usize) {
            crate::prefetch(o);
        }
    }
    /// Prefetches the start of `v`'s row (reading its offsets, which
    /// [`CsrView::prefetch_offsets`] should have brought in earlier).
    #[inline(always)]
    pub fn prefetch_row(&self, v: u32) {
        if let Some(&start) = self.offsets.get(v as usize) {
            if let Some(first) = self.indices.get(start as usize) {
                crate::prefetch(first);
            }
        }
    }
    /// Prefetches up to `lines` cache lines of `v`'s row (a sampler picks sources all over
    /// a row, not only at its start); needs its offsets in cache, as [`CsrView::prefetch_row`].
    #[inline(always)]
    pub fn prefetch_row_lines(&self, v: u32, lines: usize) {
        const PER_LINE: usize = 64 / std::mem::size_of::<u32>();
        let v = v as usize;
        if let (Some(&start), Some(&end)) = (self.offsets.get(v), self.offsets.get(v + 1)) {
            let row = &self.indices[start as usize..end as usize];
            for i in (0..row.len()).step_by(PER_LINE).take(lines) {
                crate::prefetch(&row[i]);
            }
        }
    }
    pub fn degree(&self, v: u32) -> usize {
        let v = v as usize;
        (self.offsets[v + 1] - self.offsets[v]) as usize
    }
    /// Whether the edge `src -> dst` exists (rows are sorted, so this is a binary search).
    pub fn has_edge(&self, src: u32, dst: u32) -> bool {
        self.neighbors(dst).binary_search(&src).is_ok()
    }
    /// Consecutive row ranges covering `rows`, each with at most about `max_edges` edges
    /// (a longer row is a range of its own): the unit of chunked passes over big graphs.
    pub fn row_blocks(
        &self,
        rows: std::ops::Range<usize>,
        max_edges: u64,
    ) -> impl Iterator<Item = std::ops::Range<usize>> + '_ {
        let n = rows.end.min(self.num_vertices());
        let mut start = rows.start;
        std::iter::from_fn(move || {
            if start >= n {
                return None;
            }
            let limit = self.offsets[start].saturating_add(max_edges.max(1));
            // The last row whose end stays within the limit, at least one row.
            let end = (self.offsets.partition_point(|&o| o <= limit) - 1).clamp(start + 1, n);
            let block = start..end;
            start = end;
            Some(block)
        })
    }

    pub fn to_owned(&self) -> CsrGraph {
        CsrGraph {
            offsets: self.offsets.to_vec(),
            indices: self.indices.to_vec(),
        }
    }
    /// The reversed graph (row `v` lists the destinations of edges out of `v`).
    pub fn transpose(&self) -> CsrGraph {
        let n = self.num_vertices();
        let mut counts = vec![0u64; n + 1];
        for &src in self.indices {
            counts[src as usize + 1] += 1;
        }
        for i in 0..n {
            counts[i + 1] += counts[i];
        }
        let offsets = counts.clone();
        let mut cursor = counts;
        let mut indices = vec![0u32; self.indices.len()];
        // Visiting destinations in ascending order keeps every transposed row sorted.
        for dst in 0..n as u32 {
            for &src in self.neighbors(dst) {
                let slot = &mut cursor[src as usize];
                indices[*slot as usize] = dst;
                *slot += 1;
            }
        }
        CsrGraph { offsets, indices }
    }
    /// True when every edge has its reverse.
    pub fn is_symmetric(&self) -> bool {
        (0..self.num_vertices() as u32).into_par_iter().all(|dst| {
            self.neighbors(dst)
                .iter()
                .all(|&src| self.has_edge(dst, src))
        })
    }
    pub fn degree_stats(&self) -> DegreeStats {
        DegreeStats::of(self)
    }
}

/// An owned CSR graph.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct CsrGraph {
    pub offsets: Vec<u64>,
    pub indices: Vec<u32>,
}

impl CsrGraph {
    pub fn view(&self) -> CsrView<'_> {
        CsrView {
            offsets: &self.offsets,
            indices: &self.indices,
        }
    }

    /// Joins CSRs built over consecutive runs of rows (each one's offsets starting at 0) into
    /// one, rows in part order: a part's offsets are shifted by the edges before it. What a
    /// builder that makes rows in chunks on the thread pool needs; see [`concat_parts`] for
    /// why one part is free and more are copied in parallel.
    pub fn join(mut parts: Vec<CsrGraph>) -> CsrGraph {
        if parts.len() == 1 {
            return parts.pop().unwrap_or_default();
        }
        // Each part's offsets shifted by the edges before it, in place; its leading 0 is
        // left out of the copy (the joined offsets have one, first).
        let mut edges = 0u64;
        let mut offsets = Vec::with_capacity(parts.len());
        let mut indices = Vec::with_capacity(parts.len());
        for part in parts {
            let mut shifted = part.offsets;
            shifted.iter_mut().for_each(|o| *o += edges);
            edges = shifted.last().copied().unwrap_or(edges);
            offsets.push(shifted);
            indices.push(part.indices);
        }
        let mut from = Vec::with_capacity(offsets.len() + 1);
        from.push(&[0u64][..]);
        from.extend(offsets.iter().map(|o| o.get(1..).unwrap_or(&[])));
        CsrGraph {
            offsets: copy_in_parallel(&from),
            indices: concat_parts(indices),
        }
    }
}

impl CsrGraph {
    /// Items `0..keys.len()` grouped by key (a counting sort): row `g < groups` lists, in
    /// ascending order, the items `i` with `keys[i] == g`. Every key must be below `groups`.
    pub fn group_by_key(keys: &[u32], groups: usize) -> CsrGraph {
        let mut offsets = vec![0u64; groups + 1];
        for &k in keys {
            offsets[k as usize + 1] += 1;
        }
        for g in 0..groups {
            offsets[g + 1] += offsets[g];
        }
        let mut cursor = offsets.clone();
        let mut indices = vec![0u32; keys.len()];
        for (i, &k) in keys.iter().enumerate() {
            let slot = &mut cursor[k as usize];
            indices[*slot as usize] = i as u32;
            *slot += 1;
        }
        CsrGraph { offsets, indices }
    }
}

/// `n` rows cut into runs for a builder that makes them on the thread pool and then joins
/// them ([`CsrGraph::join`]): one run on a one-thread pool (nothing to join, nothing copied),
/// runs of `per_task` rows otherwise. What is built must not depend on the cut.
pub fn row_runs(n: usize, per_task: usize) -> Vec<std::ops::Range<usize>> {
    let per_task = if rayon::current_num_threads() == 1 {
        n.max(1)
    } else {
        per_task.max(1)
    };
    (0..n)
        .step_by(per_task)
        .map(|a| a..(a + per_task).min(n))
        .collect()
}

/// The parts' elements back to back, in part order. A single part is moved, not copied (a
/// one-thread pool builds everything as one part); more are copied on the thread pool, each
/// into its own slice of the result, so joining costs a share of one copy per thread
/// instead of a whole copy on one.
pub fn concat_parts<T: Copy + Default + Send + Sync>(mut parts: Vec<Vec<T>>) -> Vec<T> {
    if parts.len() == 1 {
        return parts.pop().unwrap_or_default();
    }
    let slices: Vec<&[T]> = parts.iter().map(Vec::as_slice).collect();
    copy_in_parallel(&slices)
}

/// The slices back to back, each copied on the thread pool into its own part of the result.
fn copy_in_parallel<T: Copy + Default + Send + Sync>(parts: &[&[T]]) -> Vec<T> {
    let total = parts.iter().map(|p| p.len()).sum();
    let mut out = vec![T::default(); total];
    let mut rest = out.as_mut_slice();
    let mut pairs = Vec::with_capacity(parts.len());
    for &part in parts {
        let (head, tail) = std::mem::take(&mut rest).split_at_mut(part.len());
        pairs.push((head, part));
        rest = tail;
    }
    pairs
        .into_par_iter()
        .for_each(|(dst, src)| dst.copy_from_slice(src));
    out
}

/// Degree distribution summary for `grandis data info`.
#[derive(Debug, Clone, PartialEq, serde::Serialize)]
pub struct DegreeStats {
    pub min: u64,
    pub max: u64,
    pub mean: f64,
    pub median: u64,
    pub p99: u64,
    pub isolated: u64,
}

impl DegreeStats {
    fn of(graph: &CsrView<'_>) -> DegreeStats {
        let n = graph.num_vertices();
        if n == 0 {
            return DegreeStats {
                min: 0,
                max: 0,
                mean: 0.0,
                median: 0,
                p99: 0,
                isolated: 0,
            };
        }
        let mut degrees: Vec<u64> = graph.offsets.windows(2).map(|w| w[1] - w[0]).collect();
        let isolated = degrees.iter().filter(|&&d| d == 0).count() as u64;
        degrees.par_sort_unstable();
        let at = |q: f64| degrees[((n - 1) as f64 * q).round() as usize];
        DegreeStats {
            min: degrees[0],
            max: degrees[n - 1],
            mean: graph.num_edges() as f64 / n as f64,
            median: at(0.5),
            p99: at(0.99),
            isolated,
        }
    }
}

#[cfg(test)]
mod tests {
    use crate::EdgeOptions;

    #[test]
    fn row_blocks_cover_all_rows_within_the_edge_bound() {
        let g = crate::graph_from_edges(
            6,
            [(0, 0), (1, 0), (2, 0), (0, 1), (3, 3), (4, 3), (5, 5)],
            EdgeOptions::default(),
        )
        .unwrap();
        let blocks: Vec<_> = g.view().row_blocks(0..6, 2).collect();
        // Row 0 has 3 edges (a block of its own); then rows 1-2 (1 edge), 3-4 (2), 5 (1).
        assert_eq!(blocks, vec![0..1, 1..3, 3..5, 5..6]);
        assert_eq!(
            g.view().row_blocks(0..6, 100).collect::<Vec<_>>(),
            vec![0..6]
        );
        // A sub-range starts and ends where asked (row 3 alone exceeds the bound, so the
        // empty row 2 cannot join it).
        assert_eq!(
            g.view().row_blocks(2..5, 1).collect::<Vec<_>>(),
            vec![2..3, 3..4, 4..5]
        );
    }

    /// Joining a graph cut at any rows gives the graph back, whether it is one part, many,
    /// or has empty parts.
    #[test]
    fn grouping_by_key_lists_each_keys_items_in_order() {
        let g = crate::CsrGraph::group_by_key(&[2, 0, 2, 1, 0], 4);
        assert_eq!(g.offsets, [0, 2, 3, 5, 5]);
        assert_eq!(g.indices, [1, 4, 3, 0, 2]);
        assert_eq!(crate::CsrGraph::group_by_key(&[], 2).offsets, [0, 0, 0]);
    }

    #[test]
    fn join_of_row_runs_is_the_whole_graph() {
        let g = crate::graph_from_edges(
            6,
            [(0, 0), (1, 0), (2, 0), (0, 1), (3, 3), (4, 3), (5, 5)],
            EdgeOptions::default(),
        )
        .unwrap();
        let part = |rows: std::ops::Range<usize>| {
            let lo = g.offsets[rows.start];
            super::CsrGraph {
                offsets: g.offsets[rows.start..=rows.end]
                    .iter()
                    .map(|o| o - lo)
                    .collect(),
                indices: g.indices[lo as usize..g.offsets[rows.end] as usize].to_vec(),
            }
        };
        for cuts in [
            vec![0, 6],
            vec![0, 1, 6],
            vec![0, 2, 2, 3, 5, 6],
            vec![0, 0, 6, 6],
        ] {
            let parts = cuts.windows(2).map(|w| part(w[0]..w[1])).collect();
            assert_eq!(super::CsrGraph::join(parts), g, "cuts {cuts:?}");
        }
        assert_eq!(
            super::concat_parts(vec![vec![1u64, 2], vec![], vec![3]]),
            vec![1, 2, 3]
        );
        assert!(super::concat_parts::<u8>(Vec::new()).is_empty());
    }

    #[test]
    fn transpose_reverses_edges() {
        let g =
            crate::graph_from_edges(3, [(0, 1), (0, 2), (2, 1)], EdgeOptions::default()).unwrap();
        let t = g.view().transpose();
        assert!(t.view().has_edge(1, 0) && t.view().has_edge(2, 0) && t.view().has_edge(1, 2));
        assert_eq!(t.view().num_edges(), 3);
        assert_eq!(t.view().transpose(), g);
    }
}
