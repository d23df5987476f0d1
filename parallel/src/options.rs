//! Run options: the scheme ([`Mode`]), the sampler ([`Sampling`]) and [`ParallelOptions`].

use grandis_fabric::LinkModel;
use grandis_sampling::{Eas, Exact, Fanout, Priority, Saint, SaintKind, Sampler};
use serde::Serialize;

/// Which partition-parallel scheme.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum Mode {
    /// FB_base: one-hop halo exchange at every layer with every peer.
    Fb,
    /// Flexible preloading (k hops) with one-hop graph masking.
    Flx,
    /// Cooperative batching: one co-batch MFG per server per iteration.
    Cob,
    /// Per-GPU mini-batches: one MFG per device per iteration, no sharing.
    Mb,
}

impl Mode {
    pub fn parse(s: &str) -> Option<Mode> {
        match s {
            "fb" => Some(Mode::Fb),
            "flx" => Some(Mode::Flx),
            "cob" => Some(Mode::Cob),
            "mb" => Some(Mode::Mb),
            _ => None,
        }
    }
    pub fn name(self) -> &'static str {
        match self {
            Mode::Fb => "fb",
            Mode::Flx => "flx",
            Mode::Cob => "cob",
            Mode::Mb => "mb",
        }
    }
}

/// Which dependency sampler a run uses (the seed is the training seed).
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
#[serde(tag = "sampler", rename_all = "lowercase")]
pub enum Sampling {
    /// Exact dependencies.
    None,
    /// Expansion-aware sampling: at most `fanout` external in-neighbours per vertex, external
    /// vertices at most `hops` hops from the server.
    Eas {
        hops: usize,
        fanout: usize,
        priority: Priority,
    },
    /// GraphSAGE layer-wise fanouts, hop 1 (the last layer) first.
    Fanout { fanouts: Vec<usize> },
    /// GraphSAINT per server per iteration with a budget of the co-batch size: the node
    /// sampler (`walk_length` None) or random walks of `walk_length` steps from
    /// `budget / (walk_length + 1)` roots.
    Saint { walk_length: Option<usize> },
}

impl Sampling {
    /// The dependency sampler (None for GraphSAINT, which samples targets too).
    pub fn sampler(&self, seed: u64) -> anyhow::Result<Option<Box<dyn Sampler>>> {
        Ok(match self {
            Sampling::None => Some(Box::new(Exact)),
            Sampling::Eas {
                hops,
                fanout,
                priority,
            } => Some(Box::new(Eas::new(*hops, *fanout, *priority, seed)?)),
            Sampling::Fanout { fanouts } => Some(Box::new(Fanout::new(fanouts.clone(), seed)?)),
            Sampling::Saint { .. } => None,
        })
    }

    /// The GraphSAINT sampler for a per-server budget.
    pub fn saint(&self, budget: usize, seed: u64) -> Option<Saint> {
        match self {
            Sampling::Saint { walk_length } => Some(Saint {
                kind: match walk_length {
                    None => SaintKind::Node { budget },
                    Some(len) => SaintKind::RandomWalk {
                        roots: (budget / (len + 1)).max(1),
                        length: *len,
                    },
                },
                seed,
            }),
            _ => None,
        }
    }

    pub fn is_none(&self) -> bool {
        matches!(self, Sampling::None)
    }
}

/// Options of a parallel run beyond the model and optimiser.
#[derive(Debug, Clone)]
pub struct ParallelOptions {
    pub mode: Mode,
    /// FLX: force k instead of choosing it from the memory budget.
    pub preload_hops: Option<usize>,
    /// FLX: per-device memory budget in bytes; None =
    /// [`default_device_memory`](crate::default_device_memory).
    pub device_memory: Option<u64>,
    pub intra: LinkModel,
    pub inter: LinkModel,
    /// Rayon threads of each rank's CPU backend; None = cores / ranks, at least 1.
    pub threads_per_rank: Option<usize>,
    /// Evaluate (dropout off) after every epoch, as `--mode single` does; benchmarks skip it.
    pub eval_every_epoch: bool,
    /// Return the final logits of every vertex (tests).
    pub collect_logits: bool,
    /// Dependency sampling (FLX: EAS or fanout; CoB: any; MB: none, EAS or fanout).
    pub sampling: Sampling,
    /// CoB: co-batch size per server; MB: mini-batch size per device.
    pub batch_size: Option<usize>,
    /// FLX-EAS: draw a new sample every N epochs (None or 0: sample once).
    pub resample_every: Option<u64>,
}

impl Default for ParallelOptions {
    fn default() -> Self {
        ParallelOptions {
            mode: Mode::Fb,
            preload_hops: None,
            device_memory: None,
            intra: LinkModel::unlimited(),
            inter: LinkModel::unlimited(),
            threads_per_rank: None,
            eval_every_epoch: true,
            collect_logits: false,
            sampling: Sampling::None,
            batch_size: None,
            resample_every: None,
        }
    }
}

/// The `--sampling` flag value that selects `s` (for error messages).
pub(crate) fn sampling_flag(s: &Sampling) -> &'static str {
    match s {
        Sampling::None => "none",
        Sampling::Eas { .. } => "eas",
        Sampling::Fanout { .. } => "fanout",
        Sampling::Saint { .. } => "saint",
    }
}
