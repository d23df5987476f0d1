//! Everything plan building reads: the graph, its layout and split membership.

use grandis_store::CsrView;

use crate::error::{MaskingError, Result};
use crate::layout::Layout;

/// Bit of [`SplitMembership::flags`] for training vertices.
pub const SPLIT_TRAIN: u8 = 1;
/// Bit for validation vertices.
pub const SPLIT_VAL: u8 = 2;
/// Bit for test vertices.
pub const SPLIT_TEST: u8 = 4;

/// Train/val/test membership of every global vertex as bit flags (a vertex may be in none).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SplitMembership {
    flags: Vec<u8>,
}

impl SplitMembership {
    /// No vertex in any split (for planning without labels, e.g. `choose_k`).
    pub fn none(num_vertices: usize) -> SplitMembership {
        SplitMembership {
            flags: vec![0; num_vertices],
        }
    }

    /// From the dataset's id lists (in the partitioner's relabelled ids).
    pub fn from_lists(
        num_vertices: usize,
        train: &[u32],
        val: &[u32],
        test: &[u32],
    ) -> Result<SplitMembership> {
        let mut flags = vec![0u8; num_vertices];
        for (name, ids, bit) in [
            ("train", train, SPLIT_TRAIN),
            ("val", val, SPLIT_VAL),
            ("test", test, SPLIT_TEST),
        ] {
            for &id in ids {
                let slot = flags
                    .get_mut(id as usize)
                    .ok_or(MaskingError::SplitOutOfRange {
                        split: name,
                        id,
                        num_vertices,
                    })?;
                *slot |= bit;
            }
        }
        Ok(SplitMembership { flags })
    }

    pub fn flags(&self, v: u32) -> u8 {
        self.flags[v as usize]
    }
    pub fn len(&self) -> usize {
        self.flags.len()
    }
    pub fn is_empty(&self) -> bool {
        self.flags.is_empty()
    }
}

/// The validated inputs of plan building, shared by the FB and FLX builders and the memory
/// model. Plans read in-neighbours only (placement counts a vertex's readers from their kept
/// rows), so no transposed graph is held.
pub struct PlanContext<'a> {
    graph: CsrView<'a>,
    /// Whether the caller knows the graph to be symmetric (fine clustering uses it).
    symmetric: bool,
    layout: Layout,
    splits: SplitMembership,
    /// One bit per vertex: does it have a full-graph in-neighbour homed on another server
    /// (computed on first use, one pass over the graph, then O(1) per vertex).
    crosses: std::sync::OnceLock<Vec<u64>>,
}

impl<'a> PlanContext<'a> {
    pub fn new(
        graph: CsrView<'a>,
        layout: Layout,
        splits: SplitMembership,
    ) -> Result<PlanContext<'a>> {
        Self::build(graph, false, layout, splits)
    }

    /// [`new`](Self::new) for a graph the caller knows to be symmetric (every edge u→v has
    /// v→u, as a dataset's manifest records).
    pub fn symmetric(
        graph: CsrView<'a>,
        layout: Layout,
        splits: SplitMembership,
    ) -> Result<PlanContext<'a>> {
        Self::build(graph, true, layout, splits)
    }

    fn build(
        graph: CsrView<'a>,
        symmetric: bool,
        layout: Layout,
        splits: SplitMembership,
    ) -> Result<PlanContext<'a>> {
        let n = graph.num_vertices();
        if n as u64 != layout.num_vertices() as u64 {
            return Err(MaskingError::VertexCountMismatch {
                graph: n,
                layout: layout.num_vertices() as u64,
            });
        }
        if splits.len() != n {
            return Err(MaskingError::Internal(format!(
                "split membership covers {} vertices, the graph has {n}",
                splits.len()
            )));
        }
        Ok(PlanContext {
            graph,
            symmetric,
            layout,
            splits,
            crosses: std::sync::OnceLock::new(),
        })
    }

    pub fn graph(&self) -> CsrView<'a> {
        self.graph
    }
    /// Whether the context was built for a symmetric graph (every edge has its reverse).
    pub fn is_symmetric(&self) -> bool {
        self.symmetric
    }
    pub fn layout(&self) -> &Layout {
        &self.layout
    }
    pub fn splits(&self) -> &SplitMembership {
        &self.splits
    }
    pub fn num_vertices(&self) -> usize {
        self.graph.num_vertices()
    }
    /// Sources of the edges into `v` (the CSR row).
    pub fn in_neighbors(&self, v: u32) -> &'a [u32] {
        self.graph.neighbors(v)
    }
    /// In-degree of `v` in the FULL graph (what normalisation must use on a partial graph).
    pub fn in_degree(&self, v: u32) -> u32 {
        self.graph.degree(v) as u32
    }
    /// Whether `v` has an in-neighbour in the full graph homed on another server than `v`
    /// (its inputs cross the server boundary): the first call sets a bit per vertex in one
    /// parallel pass, so per-step statistics never walk full in-neighbour lists.
    pub fn reads_across_servers(&self, v: u32) -> bool {
        if self.layout.servers() == 1 {
            return false;
        }
        let bits = self.crosses.get_or_init(|| {
            use rayon::prelude::*;
            let n = self.num_vertices();
            (0..n.div_ceil(64))
                .into_par_iter()
                .map(|w| {
                    let mut word = 0u64;
                    for v in (w * 64) as u32..((w + 1) * 64).min(n) as u32 {
                        let home = self.layout.server_range(self.layout.server_of(v));
                        if self.in_neighbors(v).iter().any(|u| !home.contains(u)) {
                            word |= 1 << (v % 64);
                        }
                    }
                    word
                })
                .collect()
        });
        bits[v as usize / 64] >> (v % 64) & 1 == 1
    }
}
