//! Random planning inputs for property tests (feature `testing`): a graph, a two-level layout
//! over it and a train split, within bounds the caller picks. Used by this crate's tests and
//! by those of the crates that build on its plans (sampling), so they explore the same space.

use grandis_store::{CsrGraph, EdgeOptions};
use proptest::prelude::*;

use crate::context::{PlanContext, SplitMembership};
use crate::layout::Layout;

/// The global ids of the sources row `i` of device plan `d` reads at layer `l`, ascending:
/// what a property test compares with the edges it expects kept.
pub fn read_globals(d: &crate::DevicePlan, l: usize, i: u32) -> Vec<u32> {
    let mut read: Vec<u32> = d
        .layer_graph(l)
        .neighbors(i)
        .iter()
        .map(|&x| d.global_ids[x as usize])
        .collect();
    read.sort_unstable();
    read
}

/// An undirected graph of `n` vertices with `edges` (each stored in both directions): the
/// hand-checked cases' graphs.
pub fn undirected(n: u64, edges: &[(u32, u32)]) -> CsrGraph {
    let opts = EdgeOptions {
        symmetrize: true,
        ..Default::default()
    };
    grandis_store::graph_from_edges(n, edges.iter().copied(), opts).expect("a valid edge list")
}

/// The hand-checked cases' layout of 8 vertices: two servers of two devices, two vertices
/// each (0-1, 2-3 | 4-5, 6-7), with `splits`.
pub fn two_by_two_of_eight(graph: &CsrGraph, splits: SplitMembership) -> PlanContext<'_> {
    let layout = Layout::from_bounds(2, 2, &[0, 2, 4, 6, 8]).expect("the 2 x 2 layout");
    PlanContext::new(graph.view(), layout, splits).expect("a hand case's context")
}

/// The planning context of `graph` on one server of one device, with no split: what a test
/// of one vertex's draws needs.
pub fn one_device(graph: &CsrGraph) -> PlanContext<'_> {
    let n = graph.view().num_vertices();
    PlanContext::new(
        graph.view(),
        Layout::even(n as u32, 1, 1).expect("one rank's layout"),
        SplitMembership::none(n),
    )
    .expect("a context on one device")
}

/// One random planning input.
#[derive(Debug, Clone)]
pub struct Case {
    pub graph: CsrGraph,
    pub layout: Layout,
    /// Train vertices, ascending.
    pub train: Vec<u32>,
}

/// How large a [`case`] may be.
#[derive(Debug, Clone, Copy)]
pub struct CaseBounds {
    pub max_servers: usize,
    pub max_devices: usize,
    pub max_vertices: u32,
    /// Up to this many random directed edges per vertex (before optional symmetrisation).
    pub edges_per_vertex: usize,
}

/// A graph of 1..=`max_vertices` vertices with random (possibly self-loop, possibly
/// duplicate) edges, symmetrised or not; a layout of 1..=`max_servers` × 1..=`max_devices`
/// ranks with random, possibly empty ranges; a random train split.
pub fn case(bounds: CaseBounds) -> impl Strategy<Value = Case> {
    (
        1usize..=bounds.max_servers,
        1usize..=bounds.max_devices,
        1u32..=bounds.max_vertices,
        any::<bool>(),
    )
        .prop_flat_map(move |(servers, devices, n, symmetric)| {
            let ranks = servers * devices;
            (
                prop::collection::vec((0..n, 0..n), 0..=(n as usize * bounds.edges_per_vertex)),
                prop::collection::vec(0..=n, ranks - 1),
                prop::collection::vec(any::<bool>(), n as usize),
            )
                .prop_map(move |(edges, mut cuts, is_train)| {
                    let graph = grandis_store::graph_from_edges(
                        n as u64,
                        edges,
                        EdgeOptions {
                            symmetrize: symmetric,
                            ..Default::default()
                        },
                    )
                    .expect("edges within the vertex range");
                    cuts.sort_unstable();
                    let mut bounds = vec![0];
                    bounds.extend(cuts);
                    bounds.push(n);
                    let layout = Layout::from_bounds(servers, devices, &bounds)
                        .expect("sorted bounds ending at n");
                    let train = (0..n).filter(|&v| is_train[v as usize]).collect();
                    Case {
                        graph,
                        layout,
                        train,
                    }
                })
        })
}

impl Case {
    /// The planning context of this case (train split only).
    pub fn ctx(&self) -> PlanContext<'_> {
        let n = self.graph.view().num_vertices();
        let splits =
            SplitMembership::from_lists(n, &self.train, &[], &[]).expect("train ids are vertices");
        PlanContext::new(self.graph.view(), self.layout.clone(), splits)
            .expect("a valid layout of the graph")
    }
}
