//! Compressed sparse rows, and the one place where raw edge lists become CSR.
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
    pub fn degree(&self, v: u32) -> usize {
        let v = v as usize;
        (self.offsets[v + 1] - self.offsets[v]) as usize
    }
    /// Whether the edge `src -> dst` exists (rows are sorted, so this is a binary search).
    pub fn has_edge(&self, src: u32, dst: u32) -> bool {
        self.neighbors(dst).binary_search(&src).is_ok()
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
    /// Builds a graph from `(src, dst)` pairs with the given options (convenience for tests
    /// and small graphs; importers stream through [`EdgeListBuilder`] directly).
    pub fn from_edges(
        num_vertices: u64,
        edges: impl IntoIterator<Item = (u32, u32)>,
        options: EdgeOptions,
    ) -> Result<CsrGraph, EdgeError> {
        let mut builder = EdgeListBuilder::new(options);
        for (src, dst) in edges {
            builder.push(src, dst)?;
        }
        Ok(builder.finish(Some(num_vertices))?.into_csr())
    }
}

/// What to do with edges from a vertex to itself.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum SelfLoops {
    /// Give every vertex exactly one self-loop.
    Add,
    /// Drop all self-loops.
    Remove,
    /// Keep the self-loops the input has (deduplicated like any edge).
    #[default]
    Keep,
}

/// How raw edges become the stored graph. Duplicate edges are always removed.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct EdgeOptions {
    /// Add the reverse of every edge.
    pub symmetrize: bool,
    pub self_loops: SelfLoops,
}

#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum EdgeError {
    #[error("vertex id {id} is out of range: the graph has {num_vertices} vertices")]
    OutOfRange { id: u64, num_vertices: u64 },
    #[error("vertex id {id} exceeds the supported maximum of {max} vertices (ids are u32)")]
    TooLarge { id: u64, max: u64 },
}

/// Collects edges and turns them into sorted, deduplicated CSR rows.
///
/// Memory: 8 bytes per (possibly symmetrized) edge while collecting, which is at most twice
/// the 4 bytes per edge of the stored graph; the final rows are produced in place.
pub struct EdgeListBuilder {
    options: EdgeOptions,
    /// `(dst << 32) | src`: sorting these groups edges by destination, then source.
    keys: Vec<u64>,
    max_id: Option<u32>,
}

impl EdgeListBuilder {
    pub fn new(options: EdgeOptions) -> Self {
        EdgeListBuilder {
            options,
            keys: Vec::new(),
            max_id: None,
        }
    }

    pub fn with_capacity(options: EdgeOptions, edges: usize) -> Self {
        let mut b = Self::new(options);
        let factor = if options.symmetrize { 2 } else { 1 };
        b.keys.reserve(edges.saturating_mul(factor));
        b
    }

    /// Checks an id coming from untrusted input and narrows it to `u32`.
    pub fn check_id(id: i64) -> Result<u32, EdgeError> {
        if id < 0 || id as u64 >= MAX_VERTICES {
            return Err(EdgeError::TooLarge {
                id: id as u64,
                max: MAX_VERTICES,
            });
        }
        Ok(id as u32)
    }

    pub fn push(&mut self, src: u32, dst: u32) -> Result<(), EdgeError> {
        if src as u64 >= MAX_VERTICES || dst as u64 >= MAX_VERTICES {
            return Err(EdgeError::TooLarge {
                id: src.max(dst) as u64,
                max: MAX_VERTICES,
            });
        }
        self.max_id = Some(self.max_id.map_or(src.max(dst), |m| m.max(src).max(dst)));
        if src == dst {
            if self.options.self_loops == SelfLoops::Keep {
                self.keys.push(key(src, dst));
            }
            return Ok(());
        }
        self.keys.push(key(src, dst));
        if self.options.symmetrize {
            self.keys.push(key(dst, src));
        }
        Ok(())
    }

    /// Number of vertices implied by the largest id seen so far.
    pub fn implied_vertices(&self) -> u64 {
        self.max_id.map_or(0, |m| m as u64 + 1)
    }

    /// Sorts and deduplicates. `num_vertices` defaults to one past the largest id seen;
    /// when given, every id must be below it.
    pub fn finish(mut self, num_vertices: Option<u64>) -> Result<SortedEdges, EdgeError> {
        let implied = self.implied_vertices();
        let n = match num_vertices {
            Some(n) if implied > n => {
                return Err(EdgeError::OutOfRange {
                    id: implied - 1,
                    num_vertices: n,
                })
            }
            Some(n) if n > MAX_VERTICES => {
                return Err(EdgeError::TooLarge {
                    id: n - 1,
                    max: MAX_VERTICES,
                })
            }
            Some(n) => n,
            None => implied,
        };
        if self.options.self_loops == SelfLoops::Add {
            self.keys.reserve(n as usize);
            self.keys.extend((0..n as u32).map(|v| key(v, v)));
        }
        self.keys.par_sort_unstable();
        self.keys.dedup();
        self.keys.shrink_to_fit();
        Ok(SortedEdges {
            num_vertices: n,
            keys: self.keys,
        })
    }
}

fn key(src: u32, dst: u32) -> u64 {
    ((dst as u64) << 32) | src as u64
}

/// Edges sorted by (destination, source) without duplicates: CSR rows in all but layout.
pub struct SortedEdges {
    num_vertices: u64,
    keys: Vec<u64>,
}

impl SortedEdges {
    pub fn num_vertices(&self) -> u64 {
        self.num_vertices
    }
    pub fn num_edges(&self) -> u64 {
        self.keys.len() as u64
    }
    /// Row offsets (length `num_vertices + 1`).
    pub fn offsets(&self) -> Vec<u64> {
        let n = self.num_vertices as usize;
        let mut offsets = vec![0u64; n + 1];
        for &k in &self.keys {
            offsets[(k >> 32) as usize + 1] += 1;
        }
        for i in 0..n {
            offsets[i + 1] += offsets[i];
        }
        offsets
    }
    /// Source ids in row order, in chunks, for streaming to disk.
    pub fn for_each_source_chunk<E>(
        &self,
        mut f: impl FnMut(&[u32]) -> Result<(), E>,
    ) -> Result<(), E> {
        let mut buf = Vec::with_capacity(1 << 16);
        for chunk in self.keys.chunks(1 << 16) {
            buf.clear();
            buf.extend(chunk.iter().map(|&k| k as u32));
            f(&buf)?;
        }
        Ok(())
    }
    pub fn into_csr(self) -> CsrGraph {
        let offsets = self.offsets();
        let indices = self.keys.iter().map(|&k| k as u32).collect();
        CsrGraph { offsets, indices }
    }
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
    use super::*;

    #[test]
    fn builds_sorted_deduplicated_rows() {
        let g = CsrGraph::from_edges(
            4,
            [(1, 0), (2, 0), (1, 0), (3, 3), (0, 2)],
            EdgeOptions::default(),
        )
        .unwrap();
        assert_eq!(g.offsets, vec![0, 2, 2, 3, 4]);
        assert_eq!(g.indices, vec![1, 2, 0, 3]);
    }

    #[test]
    fn symmetrize_and_self_loop_options() {
        let opts = EdgeOptions {
            symmetrize: true,
            self_loops: SelfLoops::Remove,
        };
        let g = CsrGraph::from_edges(3, [(0, 1), (1, 1), (1, 2)], opts).unwrap();
        assert!(g.view().is_symmetric());
        assert_eq!(g.view().num_edges(), 4);
        let opts = EdgeOptions {
            symmetrize: true,
            self_loops: SelfLoops::Add,
        };
        let g = CsrGraph::from_edges(3, [(0, 1), (1, 1)], opts).unwrap();
        assert_eq!(g.view().num_edges(), 2 + 3);
        assert!(g.view().has_edge(2, 2));
    }

    #[test]
    fn out_of_range_ids_are_rejected() {
        let err = CsrGraph::from_edges(2, [(0, 5)], EdgeOptions::default()).unwrap_err();
        assert_eq!(
            err,
            EdgeError::OutOfRange {
                id: 5,
                num_vertices: 2
            }
        );
        assert!(EdgeListBuilder::check_id(-1).is_err());
        assert!(EdgeListBuilder::check_id(u32::MAX as i64).is_err());
    }

    #[test]
    fn transpose_reverses_edges() {
        let g = CsrGraph::from_edges(3, [(0, 1), (0, 2), (2, 1)], EdgeOptions::default()).unwrap();
        let t = g.view().transpose();
        assert!(t.view().has_edge(1, 0) && t.view().has_edge(2, 0) && t.view().has_edge(1, 2));
        assert_eq!(t.view().num_edges(), 3);
        assert_eq!(t.view().transpose(), g);
    }
}
