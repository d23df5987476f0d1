//! Samplers and cooperative batching for grandis (GraNNDIS §5.2, §5.3, §6). Every sampler
//! turns a server's target vertices into a per-server extraction spec of `grandis-masking`
//! (targets + kept in-edges), so every mode runs on the same one-hop-masked `DevicePlan`s:
//! expansion-aware sampling ([`Eas`]: keep every inner dependency, sample at most f external
//! in-neighbours within h hops of the server, by greedy boundary cover or uniformly), layer-wise
//! fanout sampling ([`Fanout`], GraphSAGE, as per-layer edge masks over one union graph),
//! GraphSAINT node / random-walk subgraphs ([`Saint`], the unmasked case), cooperative
//! batching ([`CoBatcher`], [`cob_plan`]: one MFG per server per co-batch, spread over its
//! devices) and the per-GPU mini-batch baseline ([`MiniBatcher`], [`mb_plans`]: one MFG per
//! device, no sharing), and GraphTheta's cluster batches ([`ClusterBatches`]: unions of
//! small clusters, each vertex's neighbours restricted to the batch). [`sample_stats`] and [`EpochStats`] count sampled edges, computed
//! vertex-layers and the boundary ratio β; [`largest_cobatch`] finds the largest co-batch that
//! fits a memory budget. No numerics live here: a runner executes the plans.

mod batch;
mod cluster;
mod eas;
mod error;
mod fanout;
mod fit;
mod numbering;
mod rng;
mod saint;
mod sampler;
mod spec;
mod stats;

pub use batch::{
    batch_specs, cob_epoch_stats, cob_plan, mb_device_plans, mb_epoch_stats, mb_plans, Batcher,
    CoBatcher, Devices, EpochStats, Grouping, MiniBatcher, Servers,
};
pub use cluster::ClusterBatches;
pub use eas::{external_distance, Eas, Priority};
pub use error::{Result, SamplingError};
pub use fanout::{Fanout, RelationFanouts};
pub use fit::{largest_cobatch, largest_fitting, CobatchFit};
pub use saint::{Saint, SaintKind};
pub use sampler::{round_for_epoch, round_of, Exact, Sampler};
pub use spec::{dependency_sampler, saint_sampler, TypedGraph};
pub use stats::{boundary_ratio, device_counts, sample_stats, SampleStats};
