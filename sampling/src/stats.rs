//! Statistics of sampled plans for run summaries.
//!
//! - `sampled_edges`: edges of all devices' one-hop graphs (the kept in-edges of complete
//!   rows; with per-layer sampling the union over layers).
//! - `computed_vertices_per_layer[l]`: Σ over devices of the rows valid at the output of layer
//!   l (the rows a runner computes); `computed_vertex_layers` is their sum.
//! - `aggregated_edges_per_layer[l]`: Σ over those rows of the edges they aggregate at l.
//! - Boundary ratio β of a server (§5.3.2, "the number of boundary vertices / the number of
//!   replicated vertices"), our exact definition: over the server's EXTRACTED vertices X (all
//!   owned rows of its devices: targets, dependencies and leaves), β = |B| / |X| where B = the
//!   vertices of X that are external to the server or have at least one FULL-graph
//!   in-neighbour external to it (the vertices whose inputs cross the boundary, where EAS
//!   samples). α = 1 - β is the share of inner vertices that need nothing from outside; β = 0
//!   for an empty extraction.

use grandis_masking::{DevicePlan, FlxPlan, PlanContext};

/// Counters of one masked plan.
#[derive(Debug, Clone, PartialEq, serde::Serialize)]
pub struct SampleStats {
    pub sampled_edges: u64,
    pub computed_vertices_per_layer: Vec<u64>,
    pub computed_vertex_layers: u64,
    pub aggregated_edges_per_layer: Vec<u64>,
    /// β per server (see the module doc).
    pub boundary_ratio: Vec<f64>,
}

/// Per-layer (computed rows, aggregated edges) of one device plan over its masked layers.
pub fn device_counts(plan: &DevicePlan) -> (Vec<u64>, Vec<u64>) {
    (0..plan.masks.len())
        .map(|l| {
            let w = plan.work_at(l);
            (w.rows, w.edges)
        })
        .unzip()
}

/// β of `server` in `plan` (see the module doc).
pub fn boundary_ratio(ctx: &PlanContext<'_>, plan: &FlxPlan, server: usize) -> f64 {
    let range = ctx.layout().server_range(server);
    let mut extracted = 0u64;
    let mut boundary = 0u64;
    for d in plan.devices.iter().filter(|d| d.server == server) {
        for &v in &d.global_ids[..d.n_owned] {
            extracted += 1;
            // A vertex of this server reads across the boundary iff one of its in-neighbours
            // is homed elsewhere: the context's per-vertex bit.
            if !range.contains(&v) || ctx.reads_across_servers(v) {
                boundary += 1;
            }
        }
    }
    if extracted == 0 {
        0.0
    } else {
        boundary as f64 / extracted as f64
    }
}

/// All counters of `plan`.
pub fn sample_stats(ctx: &PlanContext<'_>, plan: &FlxPlan) -> SampleStats {
    let mut computed = vec![0u64; plan.k];
    let mut edges = vec![0u64; plan.k];
    let mut sampled_edges = 0u64;
    for d in &plan.devices {
        let (c, e) = device_counts(d);
        add(&mut computed, &c);
        add(&mut edges, &e);
        sampled_edges += d.num_edges() as u64;
    }
    SampleStats {
        sampled_edges,
        computed_vertex_layers: computed.iter().sum(),
        computed_vertices_per_layer: computed,
        aggregated_edges_per_layer: edges,
        boundary_ratio: (0..ctx.layout().servers())
            .map(|s| boundary_ratio(ctx, plan, s))
            .collect(),
    }
}

pub(crate) fn add(acc: &mut Vec<u64>, x: &[u64]) {
    if acc.len() < x.len() {
        acc.resize(x.len(), 0);
    }
    for (a, b) in acc.iter_mut().zip(x) {
        *a += b;
    }
}
