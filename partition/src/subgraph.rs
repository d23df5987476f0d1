//! The undirected view every partitioner works on: all vertices of a CSR graph, or the
//! subgraph induced by the vertices of one server. Edges are only ever *streamed* from the
//! CSR rows (never copied), which is what lets SPRING run in O(V) memory.

use grandis_store::CsrView;

/// Restricts a graph to the vertices whose `group` entry equals `id`.
#[derive(Clone, Copy)]
pub(crate) struct Scope<'a> {
    /// Global ids of the member vertices, ascending; local id = position.
    pub members: &'a [u32],
    /// Global id -> local id (valid only for members).
    pub local: &'a [u32],
    /// Global id -> group (server) it belongs to.
    pub group: &'a [u32],
    pub id: u32,
}

#[derive(Clone, Copy)]
pub(crate) struct Subgraph<'a> {
    pub graph: CsrView<'a>,
    /// Every edge has its reverse: each undirected edge can then be streamed once.
    pub symmetric: bool,
    pub scope: Option<Scope<'a>>,
}

impl<'a> Subgraph<'a> {
    /// The subgraph induced by group `id` of `group` (per global vertex), whose vertices are
    /// `members` with local ids `local` (see [`Scope`]).
    pub fn induced(
        graph: CsrView<'a>,
        symmetric: bool,
        members: &'a [u32],
        local: &'a [u32],
        group: &'a [u32],
        id: u32,
    ) -> Subgraph<'a> {
        Subgraph {
            graph,
            symmetric,
            scope: Some(Scope {
                members,
                local,
                group,
                id,
            }),
        }
    }

    pub fn num_vertices(&self) -> usize {
        match &self.scope {
            Some(s) => s.members.len(),
            None => self.graph.num_vertices(),
        }
    }

    /// Global id of local vertex `l`.
    #[inline]
    pub fn global(&self, l: u32) -> u32 {
        match &self.scope {
            Some(s) => s.members[l as usize],
            None => l,
        }
    }

    /// In-scope neighbours (CSR row = in-neighbours) of local vertex `l`, as local ids,
    /// without self-loops.
    #[inline]
    pub fn for_each_neighbor(&self, l: u32, mut f: impl FnMut(u32)) {
        let g = self.global(l);
        match &self.scope {
            None => {
                for &src in self.graph.neighbors(g) {
                    if src != g {
                        f(src)
                    }
                }
            }
            Some(s) => {
                for &src in self.graph.neighbors(g) {
                    if src != g && s.group[src as usize] == s.id {
                        f(s.local[src as usize])
                    }
                }
            }
        }
    }

    /// Streams the edges `(u, v)` (local ids, no self-loops) in one pass over the CSR rows.
    /// For a symmetric graph each undirected edge comes exactly once (`u < v`); otherwise
    /// every stored directed edge comes once (so a reciprocated pair comes twice).
    pub fn for_each_edge(&self, mut f: impl FnMut(u32, u32)) {
        for dst in 0..self.num_vertices() as u32 {
            self.for_each_neighbor(dst, |src| {
                if !self.symmetric || src < dst {
                    f(src, dst)
                }
            });
        }
    }
}
