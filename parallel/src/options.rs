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

/// Where each rank computes.
#[derive(Debug, Clone, PartialEq, Eq, Default, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum Compute {
    /// A CPU backend per rank (its own rayon pool of `threads_per_rank`).
    #[default]
    Cpu,
    /// A CUDA backend per rank: the rank with device index `d` inside its server runs on
    /// `ordinals[d % ordinals.len()]`, or on ordinal `d % (devices the driver reports)` when no
    /// list is given. Ranks that share an ordinal each get their own stream on it.
    Cuda { ordinals: Option<Vec<usize>> },
}

impl Compute {
    /// Parses `cpu`, `cuda` (rank d on device d) or `cuda:N` (every rank on device N).
    pub fn parse(s: &str) -> anyhow::Result<Compute> {
        match s {
            "cpu" => Ok(Compute::Cpu),
            "cuda" => Ok(Compute::Cuda { ordinals: None }),
            _ => match s.strip_prefix("cuda:").map(str::parse::<usize>) {
                Some(Ok(n)) => Ok(Compute::Cuda {
                    ordinals: Some(vec![n]),
                }),
                _ => anyhow::bail!(
                    "invalid --device '{s}' (expected cpu, cuda or cuda:N, e.g. cuda:0)"
                ),
            },
        }
    }

    /// The CUDA ordinal of the rank with device index `device` inside its server, given the
    /// number of devices the driver reports.
    pub fn ordinal(&self, device: usize, available: usize) -> Option<usize> {
        match self {
            Compute::Cpu => None,
            Compute::Cuda {
                ordinals: Some(list),
            } if !list.is_empty() => Some(list[device % list.len()]),
            Compute::Cuda { .. } => Some(device % available.max(1)),
        }
    }

    pub fn is_cuda(&self) -> bool {
        matches!(self, Compute::Cuda { .. })
    }
}

/// Options of a parallel run beyond the model and optimiser.
#[derive(Debug, Clone)]
pub struct ParallelOptions {
    pub mode: Mode,
    /// Where the ranks compute (CPU threads by default).
    pub compute: Compute,
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
            compute: Compute::Cpu,
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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn compute_parses_and_maps_device_indices_to_ordinals() {
        assert_eq!(Compute::parse("cpu").unwrap(), Compute::Cpu);
        let auto = Compute::parse("cuda").unwrap();
        assert_eq!(auto, Compute::Cuda { ordinals: None });
        // Device index d on ordinal d, wrapped at the number of devices present.
        assert_eq!(
            (0..5).map(|d| auto.ordinal(d, 4)).collect::<Vec<_>>(),
            [Some(0), Some(1), Some(2), Some(3), Some(0)]
        );
        // cuda:N: every rank on N (several ranks share one GPU).
        let one = Compute::parse("cuda:1").unwrap();
        assert_eq!(one.ordinal(0, 2), Some(1));
        assert_eq!(one.ordinal(3, 2), Some(1));
        let list = Compute::Cuda {
            ordinals: Some(vec![2, 3]),
        };
        assert_eq!(
            (0..3).map(|d| list.ordinal(d, 8)).collect::<Vec<_>>(),
            [Some(2), Some(3), Some(2)]
        );
        assert_eq!(Compute::Cpu.ordinal(0, 8), None);
        for bad in ["gpu", "cuda:", "cuda:x", "CUDA", ""] {
            let err = Compute::parse(bad).unwrap_err().to_string();
            assert!(err.contains("expected cpu, cuda or cuda:N"), "{bad}: {err}");
        }
    }
}
