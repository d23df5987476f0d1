//! The `--mode auto` decision: full-batch FLX when the graph fits, else cooperative batching
//! with the largest co-batch that fits.
//!
//! 1. [`PlanContext::choose_k`] (masking's memory model): if plain FB (k = 0) fits the
//!    per-device budget, the full graph fits the servers' aggregate memory and the decision
//!    is FLX with the largest fitting k.
//! 2. Otherwise CoB: binary search for the largest co-batch size B in `1..=max train per
//!    server` whose plan fits, where "fits" = the worst device's
//!    [`grandis_masking::estimate_masked`] of the FIRST iteration of epoch 0 with that B (with
//!    the sampler that will train) is `<= budget`. With one seed the first co-batch for a
//!    larger B is a superset of the one for a smaller B (same shuffle, longer prefix), and
//!    the exact and fanout samplers key every choice by vertex, so the estimate grows with B;
//!    other iterations are a different random draw of the same size, hence an ESTIMATE (leave
//!    headroom in the budget).

use grandis_masking::{MaskingError, ModelDims, PlanContext};

use crate::batch::{cob_plan, CoBatcher};
use crate::error::{Result, SamplingError};
use crate::sampler::Sampler;

/// What `--mode auto` runs.
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize)]
#[serde(tag = "mode", rename_all = "lowercase")]
pub enum AutoChoice {
    /// Full-batch flexible preloading with `k` preloaded hops (k = 0: plain FB).
    Flx { k: usize },
    /// Cooperative batching with co-batches of at most `batch_size` per server.
    Cob { batch_size: usize },
}

/// The decision with the numbers behind it (printable).
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize)]
pub struct AutoDecision {
    pub mode: AutoChoice,
    /// Per-device budget in bytes.
    pub budget_bytes: u64,
    /// Worst device's estimate for the chosen mode.
    pub estimate_bytes: u64,
    pub worst_rank: usize,
    pub reason: String,
}

impl std::fmt::Display for AutoDecision {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let mib = |b: u64| b as f64 / (1u64 << 20) as f64;
        match self.mode {
            AutoChoice::Flx { k } => write!(f, "mode auto -> FLX with k = {k}")?,
            AutoChoice::Cob { batch_size } => write!(
                f,
                "mode auto -> CoB with co-batch size {batch_size} per server"
            )?,
        }
        write!(
            f,
            " (estimate {:.1} MiB on rank {} of a {:.1} MiB budget): {}",
            mib(self.estimate_bytes),
            self.worst_rank,
            mib(self.budget_bytes),
            self.reason
        )
    }
}

/// Decides FLX or CoB for `dims` under a per-device `budget` (bytes); `sampler` and `seed`
/// are what CoB would train with.
pub fn auto_mode(
    ctx: &PlanContext<'_>,
    dims: &ModelDims,
    budget: u64,
    sampler: &dyn Sampler,
    seed: u64,
) -> Result<AutoDecision> {
    match ctx.choose_k(dims, budget) {
        Ok(choice) => {
            let e = &choice.estimates[choice.k];
            Ok(AutoDecision {
                mode: AutoChoice::Flx { k: choice.k },
                budget_bytes: budget,
                estimate_bytes: e.max_bytes,
                worst_rank: e.worst_rank,
                reason: format!("the full graph fits; {}", choice.reason),
            })
        }
        Err(MaskingError::BudgetTooSmall { needed, rank, .. }) => {
            tracing::info!(
                needed,
                rank,
                budget,
                "FB does not fit; trying cooperative batching"
            );
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
            let max_b = CoBatcher::new(ctx, 1, seed)?
                .train()
                .iter()
                .map(Vec::len)
                .max()
                .unwrap_or(0)
                .max(1);
            let (one, one_rank) = probe(1)?;
            if one > budget {
                return Err(SamplingError::Config(format!(
                    "memory budget of {budget} bytes is too small: plain FB needs {needed} \
                     bytes on rank {rank} and even a co-batch of 1 needs {one} bytes on rank \
                     {one_rank}"
                )));
            }
            // Invariant: lo fits; hi + 1 does not (or is past max_b).
            let (mut lo, mut hi) = (1usize, max_b);
            let mut best = (one, one_rank);
            while lo < hi {
                let mid = lo + (hi - lo).div_ceil(2);
                let (bytes, r) = probe(mid)?;
                if bytes <= budget {
                    lo = mid;
                    best = (bytes, r);
                } else {
                    hi = mid - 1;
                }
            }
            Ok(AutoDecision {
                mode: AutoChoice::Cob { batch_size: lo },
                budget_bytes: budget,
                estimate_bytes: best.0,
                worst_rank: best.1,
                reason: format!(
                    "plain FB needs {needed} bytes on rank {rank}, over budget; the largest \
                     co-batch that fits with {} is {lo} of at most {max_b} training vertices \
                     per server",
                    sampler.name()
                ),
            })
        }
        Err(e) => Err(e.into()),
    }
}
