//! The largest co-batch that fits a per-device memory budget ([`largest_cobatch`]): what the
//! planner offers as cooperative batching's first candidate when the job leaves the co-batch
//! size open.
//!
//! Binary search for the largest co-batch size B in `1..=max train per server` whose plan
//! fits, where "fits" = the worst device's [`grandis_masking::estimate_masked`] of the FIRST
//! iteration of epoch 0 with that B (with the sampler that will train) is `<= budget`. With
//! one seed the first co-batch for a larger B is a superset of the one for a smaller B (same
//! shuffle, longer prefix), and the exact and fanout samplers key every choice by vertex, so
//! the estimate grows with B; other iterations are a different random draw of the same size,
//! hence an ESTIMATE (leave headroom in the budget).

use grandis_masking::{ModelDims, PlanContext};

use crate::batch::{cob_plan, CoBatcher};
use crate::error::{Result, SamplingError};
use crate::sampler::Sampler;

/// The largest co-batch that fits, with the estimate behind it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize)]
pub struct CobatchFit {
    /// Co-batch size per server.
    pub batch_size: usize,
    /// The worst device's estimate for it, and that device.
    pub estimate_bytes: u64,
    pub worst_rank: usize,
    /// The most training vertices of one server (the largest co-batch there can be).
    pub max_batch: usize,
}

/// The largest co-batch size whose first co-batch's plan fits `budget` bytes per device for
/// `dims`, sampled by `sampler` with `seed`.
pub fn largest_cobatch(
    ctx: &PlanContext<'_>,
    dims: &ModelDims,
    budget: u64,
    sampler: &dyn Sampler,
    seed: u64,
) -> Result<CobatchFit> {
    let probe = |b: usize| -> Result<(u64, usize)> {
        let batcher = CoBatcher::new(ctx, b, seed)?;
        if batcher.iterations() == 0 {
            return Err(SamplingError::Config(
                "no training vertices: cooperative batching has nothing to batch".into(),
            ));
        }
        let plan = cob_plan(ctx, &batcher.batch(0, 0)?, dims.layers, sampler, 0)?;
        let e = grandis_masking::estimate_masked(dims, &plan);
        Ok((e.max_bytes, e.worst_rank))
    };
    let max_batch = CoBatcher::new(ctx, 1, seed)?
        .train()
        .iter()
        .map(Vec::len)
        .max()
        .unwrap_or(0)
        .max(1);
    let (one, one_rank) = probe(1)?;
    if one > budget {
        return Err(SamplingError::Config(format!(
            "memory budget of {budget} bytes is too small: even a co-batch of 1 needs {one} \
             bytes on rank {one_rank}"
        )));
    }
    let mut best = (one, one_rank);
    let batch_size = largest_fitting(max_batch, |b| {
        let (bytes, r) = probe(b)?;
        let fits = bytes <= budget;
        if fits {
            best = (bytes, r);
        }
        Ok::<bool, SamplingError>(fits)
    })?;
    Ok(CobatchFit {
        batch_size,
        estimate_bytes: best.0,
        worst_rank: best.1,
        max_batch,
    })
}

/// The largest size in `1..=most` that `fits`, by binary search, for sizes that fit up to some
/// size and not past it (the caller has checked that 1 fits). The answer is the last size
/// `fits` said yes to (or 1 when it said yes to none).
pub fn largest_fitting<E>(
    most: usize,
    mut fits: impl FnMut(usize) -> std::result::Result<bool, E>,
) -> std::result::Result<usize, E> {
    // Invariant: lo fits; hi + 1 does not (or is past `most`).
    let (mut lo, mut hi) = (1usize, most.max(1));
    while lo < hi {
        let mid = lo + (hi - lo).div_ceil(2);
        if fits(mid)? {
            lo = mid;
        } else {
            hi = mid - 1;
        }
    }
    Ok(lo)
}
