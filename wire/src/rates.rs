//! What a server measured of itself when a job started: how fast its devices compute and how
//! fast its links carry data, the rates the performance model turns plan counts into seconds
//! with. Daemons send them with [`crate::JobEvent::Measured`]; the coordinator keeps the latest
//! per server (`GET /v1/cluster`, metrics) and every job report carries its server's.

use serde::{Deserialize, Serialize};

/// One link class as a rank saw it: payload bytes per second of a large message, and the
/// one-way time of a small one (both through the job's transport, framing included).
#[derive(Clone, Copy, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct LinkRate {
    pub bandwidth_bytes_per_s: f64,
    pub latency_s: f64,
}

/// How fast one device computes the two kinds of work a GNN layer is made of, on the job's
/// hidden width.
#[derive(Clone, Copy, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct ComputeRate {
    /// Dense matrix products (the layers' weights): multiply-adds × 2 per second.
    pub gemm_flops_per_s: f64,
    /// Neighbourhood aggregation: edges × columns per second, over source rows that fit the
    /// caches (8192 rows).
    pub aggregation_edge_cols_per_s: f64,
    /// The same over source rows far beyond the caches (262144 rows), as a large graph's
    /// are: every row read is a memory access.
    #[serde(default)]
    pub aggregation_uncached_edge_cols_per_s: f64,
    /// The width it was measured at (the job's hidden width).
    pub width: usize,
    /// What an aggregation pass costs per output row it walks (written once, whatever its
    /// degree), in edges of the same width: measured at `width` on rows without edges
    /// against rows of 16 edges, the rates above including that row per 16 edges. On a graph
    /// of a few edges per row (IMDB's 3), or a typed model's relations, each a pass over
    /// every row, the rows cost more than the edges. 0: not measured (rows priced in the
    /// rates only).
    #[serde(default)]
    pub aggregation_row_edges: f64,
}

/// A server's measured rates.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
#[serde(default)]
pub struct ServerRates {
    /// Where the ranks compute (`cpu`, `cuda`, `cuda:N`).
    pub device: String,
    /// One device's rate (each of the server's ranks runs on its own).
    pub compute: ComputeRate,
    /// Between the server's devices (absent with one device): the mean over its ranks.
    pub intra: Option<LinkRate>,
    /// Between this server and the others (absent with one server), measured by its head.
    pub inter: Option<LinkRate>,
    /// This host's memory-copy rate (bytes per second of one copy far beyond the caches;
    /// 0: not measured). A message is copied at least once on its way, so `intra` and
    /// `inter` are capped at it: an in-process link hands its buffer over without a copy and
    /// would otherwise measure as nearly free.
    pub memory_copy_bytes_per_s: f64,
    /// Seconds the measurement took.
    pub seconds: f64,
}
