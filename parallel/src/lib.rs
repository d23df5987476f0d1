//! Partition-parallel full-batch training of grandis (GraNNDIS §4, §5.1, §6): S servers × G
//! devices run as worker threads over the in-process fabric (`grandis-fabric`), each on its own
//! CPU backend, training the models of `grandis-models` over the per-device plans of
//! `grandis-masking`. `Mode::Fb` is FB_base (PipeGCN without the pipeline): every rank owns its
//! partition range plus a one-hop halo and, at every layer, exchanges halo features forward and
//! halo gradients backward with every peer it shares edges with, intra- and inter-server.
//! `Mode::Flx` is flexible preloading with one-hop graph masking: each server replicates the
//! k-hop in-neighbourhood of its vertices, layers `< k` run on that (masked) FLX plan with
//! intra-server exchanges only, layers `>= k` on the FB plan (the reshape); k is the largest
//! that fits the per-device memory budget unless given. Weight gradients are summed with the
//! fabric's hierarchical, bit-identical all-reduce, so all ranks keep identical weights. CUDA
//! ranks move halo rows and gradients on device transports instead ([`links`]: NCCL, or
//! device copies between ranks that share a GPU), in the same order and with the same counts. Every
//! normalisation uses GLOBAL degrees and every dropout mask is keyed by the dataset's ORIGINAL
//! vertex id, so for any partition and any k the per-epoch losses and final logits equal the
//! single-process trainer's (`grandis-trainer`) up to float summation order. A server holds
//! only its partition's features: the rows a masked plan replicates from another server are
//! fetched from their home rank whenever a rank builds a step's plans (`fetch`), and reported
//! per epoch, or once as setup for a plan that serves the whole run. Each rank's backend
//! is wrapped in [`metered::Metered`], which counts its live buffer bytes so the masking crate's
//! memory model can be checked against what a rank really holds.
//!
//! Sampled and mini-batch modes (GraNNDIS §5.2, §5.3) run on the plans of `grandis-sampling`:
//! FLX-EAS (`Mode::Flx` with [`Sampling::Eas`]) swaps the exact FLX plan for an
//! expansion-aware sampled one, resampled every `resample_every` epochs; cooperative batching
//! (`Mode::Cob`) takes one optimiser step per iteration on one co-batch plan per server
//! (exact, EAS, layer-wise fanout or GraphSAINT), spread over the server's devices with
//! one-hop masking and intra-server exchanges only; the per-GPU mini-batch baseline
//! (`Mode::Mb`) gives every device its own standalone plan. Plans of later steps are built by
//! a producer thread while the ranks compute. Rows that aggregate over a sampled subset of
//! their in-edges are normalised by the kept count (`DevicePlan::agg_degree_at`), per layer
//! for layer-wise sampling. Evaluation is exact in every mode (full neighbourhoods): FLX-EAS on
//! the FB plans it keeps, cob, mb and cluster with the layer-wise pass across the ranks that
//! prediction runs ([`infer`]); [`embeddings`] runs one forward pass on any masked
//! plan with given weights (exactness tests, `grandis analyze error`).

pub mod auto;
mod budget;
mod compute;
mod decide;
mod embed;
mod embedding_shard;
mod feed;
mod fetch;
pub mod infer;
pub mod input;
mod link_task;
pub mod links;
pub mod measure;
pub mod metered;
mod options;
pub mod planner;
mod prepare;
mod report;
mod run;
mod runtime;
pub mod server;
mod setup;
mod shared;
mod stale;
pub mod step_bench;
mod steps;
#[cfg(test)]
mod test_support;
mod timeline;
mod train;
mod worker;

pub use budget::{
    choose_preload_hops, default_budget, default_device_memory, job_dims, model_dims,
    predicted_halo_bytes,
};
pub use embed::{checkpoint_weights, embeddings, Embeddings};
pub use grandis_fabric::LinkModel;
pub use grandis_masking::FlxPlan as MaskedPlan;
/// The samplers this runner executes (re-exported so front ends need no extra dependency).
pub use grandis_sampling as sampling;
pub use grandis_wire::{JobSpec, LinkBytes, Mode, Priority, RankMemory, Sampling, TimeSplit};
pub use input::{PartGraph, PartitionedGraph};

pub use compute::{cores_per_rank, Compute, CUDA_BUILT, NOT_BUILT_WITH_CUDA};
pub use options::{Machine, ParallelOptions};
pub use report::ParallelReport;
pub use setup::plan_context;
pub use train::train;
pub use worker::EVAL_EPOCH_BIT;
