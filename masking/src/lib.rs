//! One-hop graph masking and flexible preloading for grandis (GraNNDIS §5.1, §6, §7): this
//! crate turns a graph that the two-level partitioner has relabelled (every (server, device)
//! owns a contiguous global id range, server-major, see [`Layout`]) into per-device *plans*.
//! A plan gives each device its rows in a LOCAL id space (owned rows first, then halo rows
//! grouped per peer), its one-hop src→dst graph over those rows, what it sends to and receives
//! from each peer, per-row metadata (global id, full-graph degrees, split membership) and, for
//! flexible preloading, one mask per layer saying which rows are exact. The FB plan
//! ([`FbPlan`]) is PipeGCN without the pipeline: every device exchanges halo rows with every
//! peer, inter-server included. The FLX plan ([`FlxPlan`]) replicates the k-hop in-neighbourhood
//! of each server's inner vertices so that the first k layers exchange only inside a server; the
//! remaining layers reuse the FB plan (the "reshape"), see [`PreloadPlan`]. Local rows are
//! ordered by hop level so that every mask and every per-layer exchange is a *prefix*, which
//! keeps both compute and communication piecewise sequential as the paper intends. Both masked
//! plans are built from per-server extraction specs ([`ExtractionSpec`]: target vertices, hops,
//! exact or sampled kept in-edges, optionally per layer): FLX is "targets = range, exact k-hop",
//! cooperative batching and the samplers of `grandis-sampling` use co-batches and
//! [`SampledEdges`]; sampled rows aggregate over `DevicePlan::agg_degree` kept edges. Each layer
//! runs in a compact row space holding just the rows it reads and writes ([`LayerRows`]), so a
//! masked layer costs its valid prefix, not the whole plan. The memory model ([`memory`]) prices
//! a plan per device and [`choose_k`] picks the largest k that fits a
//! budget. No numerics live here; the trainer runs layers over these plans.

mod context;
mod error;
pub mod extract;
mod flx;
mod idmap;
mod layout;
pub mod memory;
mod plan;
mod rows;
mod stats;
#[cfg(feature = "testing")]
pub mod testing;

pub use context::{PlanContext, SplitMembership, SPLIT_TEST, SPLIT_TRAIN, SPLIT_VAL};
pub use error::{MaskingError, Result};
pub use extract::{Edges, ExtractionSpec, SampledEdges};
pub use flx::{FbPlan, FlxPlan, PreloadPlan, ServerExtraction};
pub use idmap::IdMap;
pub use layout::Layout;
pub use memory::{
    choose_k, estimate, estimate_device, estimate_masked, estimate_masked_device,
    estimate_masked_inference, owned_rows_floor, AttentionDims, InputCopy, KChoice, KEstimate,
    LayerMemory, MemoryTerms, ModelDims,
};
pub use plan::{DevicePlan, HaloGroup, LayerMask, PlanWork, SendList};
pub use rows::{layer_spaces, CompactHalo, LayerRows};
pub use stats::{exchange_bytes, exchange_rows, DeviceStats, PeerHalo, PlanStats};
